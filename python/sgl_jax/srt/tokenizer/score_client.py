"""The TokenizerManager's side of /v1/score: tokenize, pick the algorithm, drive the scheduler, and turn
label log-probabilities into scores. See tokenizer/score_request.py for what is scored and
scheduler/scoring.py for the scheduler's side (including scoring-cache handles)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Dict, List, Optional

import numpy as np

from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.io_struct import (
    AbortReq,
    ScoreOut,
    ScorePrefillReq,
    ScoreReleaseOut,
    ScoreReleaseReq,
    TokenizedScoreReqInput,
)
from sgl_jax.srt.preflight import check_fits
from sgl_jax.srt.tokenizer.score_request import (
    ScoreLayout,
    ScoreReqInput,
    build_layout,
    choose_algorithm,
    chunks,
    extend_seqs,
    pack_seqs,
    scores_from_logprobs,
    serial_seqs,
    tokenize_score_input,
    validate_score_input,
)

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 30.0


class ScoreClient:
    """Runs score requests for a TokenizerManager `tm` (its sockets, tokenizer, limits and liveness).

    Results come back as ScoreOut / ScoreReleaseOut messages, routed here by `on_message`.
    """

    def __init__(self, tm):
        self.tm = tm
        self.args = tm.server_args
        self._futures: Dict[tuple, asyncio.Future] = {}
        self._background: set = set()
        self._live: set = set()  # rids of the score requests in flight
        self.num_failed_releases = 0

    def is_live(self, rid: str) -> bool:
        return rid in self._live

    def num_live(self) -> int:
        """Score requests in flight."""
        return len(self._live)

    # ------------------------------------------------------------ messages
    def on_message(self, msg) -> bool:
        """Deliver a scheduler reply; False if `msg` is not a scoring message."""
        if isinstance(msg, ScoreOut):
            key = ("score", msg.rid)
        elif isinstance(msg, ScoreReleaseOut):
            key = ("release", msg.handle)
        else:
            return False
        fut = self._futures.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(msg)
        return True

    def fail_all(self, error: Exception) -> None:
        for fut in self._futures.values():
            if not fut.done():
                fut.set_exception(error)
        self._futures.clear()

    async def _call(self, key: tuple, msg, abort_rid=None):
        self.tm._check_alive()
        fut = asyncio.get_running_loop().create_future()
        self._futures[key] = fut
        self.tm.send_to_scheduler.send_pyobj(msg)
        try:
            return await fut
        except asyncio.CancelledError:
            if abort_rid is not None and self.tm.dead_reason is None:
                self.tm.send_to_scheduler.send_pyobj(AbortReq(abort_rid, "score request aborted"))
            raise
        finally:
            self._futures.pop(key, None)

    async def _score(self, msg) -> ScoreOut:
        out = await self._call(("score", msg.rid), msg, abort_rid=msg.rid)
        if out.error is not None:
            raise RequestError(out.error, out.status_code)
        return out

    async def _score_together(self, msgs: List[TokenizedScoreReqInput]) -> List[ScoreOut]:
        """Score several requests sent to the scheduler in one ZMQ message (a list), so that it admits them
        in the same round: sent one by one, the first often arrived alone and ran a step of its own (32 items
        x 20 tokens = 640 tokens, padded to a 1,024-token bucket). Returns their ScoreOuts in order.

        Raises RequestError for the first request that fails; the others still running are aborted, as
        they are when the caller is cancelled."""
        self.tm._check_alive()
        loop = asyncio.get_running_loop()
        futs = []
        for msg in msgs:
            futs.append(loop.create_future())
            self._futures[("score", msg.rid)] = futs[-1]
        self.tm.send_to_scheduler.send_pyobj(list(msgs))
        try:
            pending = set(futs)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    out = fut.result()
                    if out.error is not None:
                        raise RequestError(out.error, out.status_code)
            return [fut.result() for fut in futs]
        except BaseException:
            for msg, fut in zip(msgs, futs):
                if not fut.done():
                    if self.tm.dead_reason is None:
                        self.tm.send_to_scheduler.send_pyobj(AbortReq(msg.rid, "score request aborted"))
                    fut.cancel()
                elif not fut.cancelled():
                    fut.exception()  # retrieved: fail_all may have set one on every batch
            raise
        finally:
            for msg in msgs:
                self._futures.pop(("score", msg.rid), None)

    async def prefill(self, handle: str, input_ids: List[int], lora: Optional[str] = None) -> ScoreOut:
        """Prefill `input_ids` into scoring-cache handle `handle` (under LoRA adapter `lora`, None: the base)."""
        return await self._score(ScorePrefillReq(handle, list(input_ids), lora_path=lora))

    async def extend(self, rid: str, handle: str, seqs, label_token_ids, lora: Optional[str] = None) -> ScoreOut:
        """Score `seqs` (ScoreSeq, tokens after the handle's query) extending `handle` (same adapter as it)."""
        return await self._score(TokenizedScoreReqInput(rid, seqs, list(label_token_ids), handle=handle,
                                                        lora_path=lora))

    async def release(self, handle: str, timeout: float = RELEASE_TIMEOUT_S) -> bool:
        """Release a handle; waits up to `timeout` s. A failure is logged, never raised."""
        try:
            out = await asyncio.wait_for(self._call(("release", handle), ScoreReleaseReq(handle)), timeout)
            if not out.success:
                logger.warning("Releasing scoring cache handle %s: %s", handle, out.message)
            return out.success
        except Exception as e:  # noqa: BLE001 -- a failed release must not fail the request
            self.num_failed_releases += 1
            logger.warning("Releasing scoring cache handle %s failed: %r", handle, e)
            return False

    def _release_in_background(self, handle: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(self.release(handle))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ------------------------------------------------------------ requests
    async def score(self, obj: ScoreReqInput) -> dict:
        """Score one request. Returns {"scores": [[float per label] per item], "prompt_tokens": int}.

        Raises:
            RequestError: 400 for an invalid request (or a missing/expired scoring-cache handle), 413 when
                a scored sequence cannot fit, 503 when the server is down, shutting down or its queue is full.
        """
        tm = self.tm
        tm.check_generates("scoring")
        tm.check_admission(1)  # (503 when shutting down or the queue is full)
        validate_score_input(obj, tm.vocab_size, self.args.max_multi_item_count)
        tm.check_lora(obj.lora_path)
        bound = tm.max_chars_per_token
        if bound and isinstance(obj.query, str):
            longest = max([len(obj.query)] + [len(t) for t in obj.items])
            if longest > tm.context_len * bound:  # cannot fit whatever the tokenization: refuse untokenized
                raise RequestError(f"a query or item of {longest} characters (at least {-(-longest // bound)} "
                                   f"tokens) is longer than the model's context length ({tm.context_len} tokens)")
        special, query, items = await tm.run_blocking(tokenize_score_input, tm.tokenizer, obj)
        delimiter = self.args.multi_item_scoring_delimiter if obj.use_delimiter else None
        layout = build_layout(special, query, items, obj.item_first, delimiter)
        algo = choose_algorithm(obj.algorithm, self.args.multi_item_algorithm, obj.item_first,
                                self.args.prefill_extend_allowed())
        self._check_lengths(layout.sequences, "a scored sequence", "A scored query + item")
        rid = obj.rid or uuid.uuid4().hex
        tm.reserve_rid(rid)
        self._live.add(rid)
        try:
            run = {"serial": self._serial, "packed": self._packed}.get(algo, self._prefill_extend)
            lps = await run(rid, layout, obj.label_token_ids, obj.lora_path)
        except asyncio.CancelledError:
            logger.info("Client disconnected: aborting score request %s", rid)
            raise
        finally:
            self._live.discard(rid)
        return {"scores": scores_from_logprobs(lps, obj.apply_softmax), "prompt_tokens": layout.prompt_tokens,
                "algorithm": algo}

    async def embed(self, ids: List[List[int]], pool: str, types: Optional[List[List[int]]] = None,
                    classify: bool = False) -> List[np.ndarray]:
        """The pooled final hidden states (float32 [hidden], in input order) of token sequences `ids`, packed
        first-fit as segments of few sequences (score_request.pack_seqs with `pool`, one of POOLING); an encoder's
        `types` (token types per token of each sequence) go with them; `classify`: the model's classification head's
        logits of each pooled state instead.

        Raises RequestError: 400 for an input longer than the model's context, 413 (preflight) when one cannot
        fit, 503 when the server is down; as `score`.
        """
        tm = self.tm
        tm.check_admission(1)
        self._check_lengths(ids, "an input", "An embedding input", param="input")
        layout = ScoreLayout([], [list(x) for x in ids], [list(x) for x in ids])
        packs, where = pack_seqs(layout, self._max_pack_len(), pool=pool)
        if types is not None:
            for pack in packs:
                pack.token_types = []
            for (p, _), t in zip(where, types):
                packs[p].token_types += list(t)
        rid = uuid.uuid4().hex
        tm.reserve_rid(rid)
        self._live.add(rid)
        try:
            res = await self._score(TokenizedScoreReqInput(f"{rid}/p", packs, [], classify=classify))
        finally:
            self._live.discard(rid)
        return [res.embeddings[p][i] for p, i in where]

    async def _serial(self, rid, layout, labels, lora: Optional[str] = None) -> List[List[float]]:
        out = []
        for k, wave in enumerate(chunks(serial_seqs(layout), self.args.multi_item_extend_batch_size)):
            res = await self._score(TokenizedScoreReqInput(f"{rid}/w{k}", wave, list(labels), lora_path=lora))
            out += [seq[0] for seq in res.label_logprobs]
        return out

    def _check_lengths(self, seqs, name: str, what: str, param: Optional[str] = None) -> None:
        """Each sequence within the context (else 400 naming `name` and `param`) and the KV pool (413:
        preflight.check_fits, naming `what`)."""
        tm = self.tm
        for seq in seqs:
            if len(seq) >= tm.context_len:
                raise RequestError(f"{name} of {len(seq)} tokens is longer than the model's context length "
                                   f"({tm.context_len} tokens)", param=param)
            check_fits(tm.kv_limits, len(seq), what=what)

    def _max_pack_len(self) -> int:
        """Tokens in one packed sequence: --max-multi-item-seq-len, within one prefill and the KV pool."""
        limits = self.tm.kv_limits
        return min(self.args.max_multi_item_seq_len, limits.max_req_input_len, limits.kv_pool_tokens - 1)

    async def _packed(self, rid, layout, labels, lora: Optional[str] = None) -> List[List[float]]:
        packs, where = pack_seqs(layout, self._max_pack_len())
        res = await self._score(TokenizedScoreReqInput(f"{rid}/p", packs, list(labels), lora_path=lora))
        return [res.label_logprobs[p][i] for p, i in where]

    async def _prefill_extend(self, rid, layout, labels, lora: Optional[str] = None) -> List[List[float]]:
        handle = f"{rid}/q"
        await self.prefill(handle, layout.prefix, lora)
        release = None
        try:
            batches = chunks(extend_seqs(layout), self.args.multi_item_extend_batch_size)
            results = await self._score_together(
                [TokenizedScoreReqInput(f"{rid}/e{k}", b, list(labels), handle=handle, lora_path=lora)
                 for k, b in enumerate(batches)])
            out = []
            for res in results:
                out += [seq[0] for seq in res.label_logprobs]
            release = self._release_in_background(handle)
            await asyncio.shield(release)
            return out
        finally:
            if release is None:  # error or client abort: release without waiting for it
                self._release_in_background(handle)
