"""The scheduler's side of /v1/score: scoring sequences, their results, and scoring-cache handles.

A `TokenizedScoreReqInput` (one "group") becomes one `Req` per sequence, each with a `ScoreSpec` and
``max_new_tokens = 0``: the sequences go through the ordinary admission, chunked prefill and release path,
and instead of sampling, the label log-probabilities at their score positions are computed from the
step's hidden states. When every sequence of a group is done, one `ScoreOut` goes straight back to the
TokenizerManager (scores need no detokenization).

Scoring-cache handles (the prefill_extend algorithm): a `ScorePrefillReq` prefills a query like any
request, but when it finishes its KV is kept -- the request stays alive as the handle, holding its
ReqToTokenPool row, its KV and its prefix-cache lock. Item sequences that name the handle start from its
query KV (``Req.fixed_prefix``), so the query is computed once. A handle is released -- through the one
`release_kv_cache` path -- on `ScoreReleaseReq`, on abort, or when unused for
--multi-item-prefill-extend-cache-timeout seconds (TTL, touched on every access; never while its items
run). A sequence naming a missing or expired handle fails its group with a clear error.

Handles cannot starve the server: admission (scheduler/admission.py) admits a new handle's query only while
the handle reserve has room (`HandleRoom`: at most max_running_requests / 2 live handles holding at most half
the KV pool, so their items always find request slots and KV), and items of live handles before anything else
(`admission_order`), so a live handle is done and released before new ones pile up.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Dict, List, Optional

import numpy as np

from sgl_jax.srt.io_struct import (
    ScoreOut,
    ScorePrefillReq,
    ScoreReleaseOut,
    ScoreReleaseReq,
    TokenizedScoreReqInput,
)
from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.preflight import KVLimits, check_fits
from sgl_jax.srt.scheduler.schedule_batch import Req, ScoreSpec
from sgl_jax.srt.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ScoreGroup:
    """The sequences of one score request still being computed."""

    rid: str
    reqs: List[Req]
    pending: int
    cached_tokens: int = 0
    classify: bool = False  # an embedding group whose pooled outputs go through the classification head


@dataclasses.dataclass
class ScoreHandle:
    """A query prefilled into the scoring cache: `req` keeps its KV until released."""

    handle: str
    req: Req
    last_access: float
    active_items: int = 0
    release_requested: bool = False


def pooled_outputs(spec: ScoreSpec) -> List[np.ndarray]:
    """An embedding sequence's outputs: per output index, the mean (in float32) of the hidden states of its score
    positions (`ScoreSpec.pool_index`): one position for last-token and CLS pooling, all for mean pooling."""
    index = np.asarray(spec.pool_index)
    rows = np.stack(spec.label_logprobs)
    return [rows[index == k].mean(axis=0, dtype=np.float32) for k in range(int(index.max()) + 1)]


class SchedulerScoring:
    """Scoring groups and handles of one scheduler.

    Args:
        memory: the rank's `KVMemory` (a handle's item sequences copy its query's slots from its request
            slot; releases go through it; items share the page-aligned part of the query).
        handle_timeout_s: TTL of an unused handle, in seconds.
        send: sends a message to the TokenizerManager.
        eos_token_ids: the model's EOS ids (for Req construction).
        clock: seconds now, for handle TTLs (the scheduler's loop clock: node 0's on every host).
        classify: a sequence-classification model's head, pooled rows float32 [N, hidden] -> logits [N, labels]
            (ModelRunner.classify); None for other models.
        lora_uid: a LoRA adapter's name -> its uid (RequestError 400 when it is not loaded; the scheduler's
            `lora_uid`), for requests that name an adapter (``lora_path``).
    """

    def __init__(self, memory, handle_timeout_s: float, send: Callable, eos_token_ids: List[int],
                 clock: Callable[[], float] = time.time,
                 classify: Optional[Callable[[np.ndarray], np.ndarray]] = None,
                 lora_uid: Optional[Callable[[str], int]] = None):
        self.memory = memory
        self.lora_uid = lora_uid
        self.classify = classify
        self.clock = clock
        self.page_size = memory.page_size
        self.handle_timeout_s = handle_timeout_s
        self.send = send
        self.eos_token_ids = eos_token_ids
        self.groups: Dict[str, ScoreGroup] = {}
        self.handles: Dict[str, ScoreHandle] = {}
        self.num_expired_handles = 0

    # ------------------------------------------------------------ requests
    def _new_req(self, rid: str, input_ids: List[int], spec: ScoreSpec, lora: tuple = (None, None)) -> Req:
        sp = SamplingParams(max_new_tokens=0, temperature=0.0)
        return Req(rid, input_ids, sp, eos_token_ids=self.eos_token_ids, seed=0, score=spec, lora_name=lora[0],
                   lora_uid=lora[1])

    def _lora_of(self, rid: str, name: Optional[str]) -> Optional[tuple]:
        """(adapter name, uid) of a scoring message's ``lora_path`` ((None, None): the base model); None when the
        adapter is not loaded (the 400 is sent)."""
        if name is None:
            return None, None
        try:
            if self.lora_uid is None:
                raise RequestError("lora_path: this server has no LoRA adapters (start it with --enable-lora)")
            return name, self.lora_uid(name)
        except RequestError as e:
            self.fail(rid, e.message, 400)
            return None

    def handle_score_request(self, msg: TokenizedScoreReqInput, limits: KVLimits) -> List[Req]:
        """Turn a score request into Reqs to queue; [] when it fails at once (the error is sent: 400 for a
        missing handle, 413 when a sequence -- with its handle's query -- cannot fit: preflight.check_fits)."""
        handle = None
        prefix: List[int] = []
        if msg.handle is not None:
            handle = self.handles.get(msg.handle)
            if handle is None or handle.release_requested:
                self.fail(msg.rid, f"scoring cache handle {msg.handle!r} is missing or expired (TTL "
                                    f"{self.handle_timeout_s:g} s); the score request was aborted", 400)
                return []
            handle.last_access = self.clock()
            prefix = handle.req.origin_input_ids
        if msg.classify and self.classify is None:
            self.fail(msg.rid, "this model has no sequence-classification head", 400)
            return []
        lora = self._lora_of(msg.rid, msg.lora_path)
        if lora is None:
            return []
        if handle is not None and handle.req.lora_name != lora[0]:
            self.fail(msg.rid, f"lora_path {lora[0]!r} differs from the scoring cache handle's "
                               f"({handle.req.lora_name!r})", 400)
            return []
        reqs = []
        for i, seq in enumerate(msg.seqs):
            ids = prefix + list(seq.input_ids)
            try:
                check_fits(limits, len(ids), what="a scored sequence")
            except RequestError as e:
                self.fail(msg.rid, e.message, e.status_code)
                return []
            spec = ScoreSpec(
                group=msg.rid, label_token_ids=list(msg.label_token_ids),
                score_positions=list(seq.score_positions),
                rope_positions=None if seq.rope_positions is None else np.asarray(seq.rope_positions, np.int32),
                segment_starts=None if seq.segment_starts is None else np.asarray(seq.segment_starts, np.int32),
                prefix_len=seq.prefix_len, handle=msg.handle,
                pool_index=None if seq.pool_index is None else list(seq.pool_index),
                token_types=None if seq.token_types is None else np.asarray(seq.token_types, np.int32),
            )
            req = self._new_req(f"{msg.rid}/{i}", ids, spec, lora)
            if handle is not None:
                aligned = len(prefix) // self.page_size * self.page_size
                req.prefix_indices = self.memory.row(handle.req)[:aligned].copy()
                req.fixed_prefix = True
                req.cacheable_len = 0  # the handle owns the query's KV: never hand it to the prefix cache
            reqs.append(req)
        if handle is not None:
            handle.active_items += len(reqs)
        self.groups[msg.rid] = ScoreGroup(msg.rid, reqs, pending=len(reqs), classify=msg.classify)
        return reqs

    def handle_prefill_request(self, msg: ScorePrefillReq) -> Optional[Req]:
        """A query prefill that becomes handle ``msg.rid`` when done; None when its adapter is not loaded (the
        400 is sent)."""
        spec = ScoreSpec(group=msg.rid, label_token_ids=[], score_positions=[], handle=msg.rid,
                         is_handle_prefill=True)
        lora = self._lora_of(msg.rid, msg.lora_path)
        return None if lora is None else self._new_req(msg.rid, list(msg.input_ids), spec, lora)

    # ------------------------------------------------------------ after a step
    def collect(self, reqs: List[Req], hidden, first_rows: List[int], starts: List[int],
                label_logprobs: Callable[[np.ndarray, List[int]], np.ndarray]) -> None:
        """Compute the label logprobs of the score positions this extend step produced (an embedding request's
        sequences keep the positions' hidden states instead).

        Args:
            reqs: requests of the step (or some of them).
            hidden: [T_pad, hidden] device array of the step's final hidden states.
            first_rows / starts: per request, its first row in the T axis and the KV position of that row
                (the step computed positions [start, kv_committed_len)).
            label_logprobs: hidden rows [N, hidden], label ids -> float32[N, L] log-probabilities.
        """
        wanted = []  # (req, row)
        for req, first, start in zip(reqs, first_rows, starts):
            if req.score is None or req.score.is_handle_prefill:
                continue
            for p in req.score.score_positions:
                if start <= p < req.kv_committed_len:
                    wanted.append((req, first + p - start))
        if not wanted:
            return
        host = np.asarray(hidden)
        by_labels: Dict[tuple, list] = {}
        for req, row in wanted:
            if req.score.pool_index is not None:
                req.score.label_logprobs.append(host[row].astype(np.float32))
                continue
            by_labels.setdefault(tuple(req.score.label_token_ids), []).append((req, row))
        for labels, entries in by_labels.items():
            lps = label_logprobs(host[[row for _, row in entries]], list(labels))
            for (req, _), lp in zip(entries, lps):
                req.score.label_logprobs.append([float(x) for x in lp])

    def on_finished(self, req: Req) -> bool:
        """Called for a finished scoring Req (instead of streaming it). Returns True when the caller
        should release its KV now (False: it became a handle and keeps its KV)."""
        spec = req.score
        if spec.is_handle_prefill:
            if req.finished_reason.type == "abort":
                self.fail(req.rid, req.finished_reason.message or "aborted", req.finished_reason.status_code)
                return True
            self.handles[req.rid] = ScoreHandle(req.rid, req, last_access=self.clock())
            self.send(ScoreOut(rid=req.rid, label_logprobs=None, prompt_tokens=len(req.origin_input_ids),
                               cached_tokens=req.cached_tokens))
            return False
        self._item_done(spec.handle)
        group = self.groups.get(spec.group)
        if group is None:  # the group already failed
            return True
        if req.finished_reason.type == "abort":
            self.abort_group(group.rid, req.finished_reason.message or "aborted", req.finished_reason.status_code)
            return True
        group.pending -= 1
        group.cached_tokens += req.cached_tokens
        if group.pending == 0:
            del self.groups[group.rid]
            pooled = group.reqs[0].score.pool_index is not None
            try:
                outputs = self._outputs(group) if pooled else None
            except Exception as exc:  # noqa: BLE001 -- the head's program failed: this request fails, not the server
                logger.exception("Pooling / classifying score request %s failed", group.rid)
                self.fail(group.rid, f"computing the request's outputs failed: {exc!r}", 500)
                return True
            self.send(ScoreOut(
                rid=group.rid, label_logprobs=None if pooled else [r.score.label_logprobs for r in group.reqs],
                prompt_tokens=sum(len(r.origin_input_ids) for r in group.reqs), cached_tokens=group.cached_tokens,
                embeddings=outputs))
        return True

    def _outputs(self, group: ScoreGroup) -> List[List[np.ndarray]]:
        """An embedding group's outputs per sequence: the pooled hidden states, or (``classify``) the head's
        logits of them, computed for the whole group at once."""
        pooled = [pooled_outputs(r.score) for r in group.reqs]
        if not group.classify:
            return pooled
        logits = self.classify(np.stack([v for seq in pooled for v in seq]))
        out, k = [], 0
        for seq in pooled:
            out.append(list(logits[k:k + len(seq)]))
            k += len(seq)
        return out

    def _item_done(self, handle_id: Optional[str]) -> None:
        handle = self.handles.get(handle_id) if handle_id is not None else None
        if handle is None:
            return
        handle.active_items -= 1
        handle.last_access = self.clock()
        if handle.active_items == 0 and handle.release_requested:
            self._release(handle)

    # ------------------------------------------------------------ aborts and handles
    def fail(self, rid: str, message: str, status_code: Optional[int]) -> None:
        self.send(ScoreOut(rid=rid, label_logprobs=None, prompt_tokens=0, cached_tokens=0, error=message,
                           status_code=status_code or 400))

    def abort_group(self, rid: str, message: str, status_code: Optional[int] = None) -> List[Req]:
        """Fail group `rid` (error sent once); returns its Reqs that are still unfinished, for the
        scheduler to drop from its queue or mark to_abort."""
        group = self.groups.pop(rid, None)
        if group is None:
            return []
        self.fail(rid, message, status_code)
        return [r for r in group.reqs if not r.finished()]

    def release_request(self, msg: ScoreReleaseReq) -> None:
        """Release a handle now, or once its running items are done; always answers."""
        handle = self.handles.get(msg.handle)
        if handle is None:
            self.send(ScoreReleaseOut(msg.handle, False, f"scoring cache handle {msg.handle!r} is missing or "
                                                         "already released"))
            return
        handle.release_requested = True
        if handle.active_items == 0:
            self._release(handle)
        self.send(ScoreReleaseOut(msg.handle, True, "released"))

    def _release(self, handle: ScoreHandle) -> None:
        self.handles.pop(handle.handle, None)
        self.memory.release(handle.req)

    def expire_handles(self, now: Optional[float] = None) -> int:
        """Release handles unused for longer than the TTL (none while its items run). Returns how many."""
        now = self.clock() if now is None else now
        expired = [h for h in self.handles.values()
                   if h.active_items == 0 and now - h.last_access > self.handle_timeout_s]
        for h in expired:
            logger.warning("Scoring cache handle %s unused for %.0f s (TTL %g s): released, %d tokens of KV",
                           h.handle, now - h.last_access, self.handle_timeout_s, len(h.req.origin_input_ids))
            self._release(h)
        self.num_expired_handles += len(expired)
        return len(expired)
