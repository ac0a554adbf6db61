"""Req and ScheduleBatch: the scheduler's pure data structures (no ZMQ, no JAX).

A ScheduleBatch turns into a `ModelWorkerBatch` of host numpy arrays padded to a compiled bucket
(`build_model_worker_batch`); the model runner moves it to device as a `ForwardBatch`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, List, Optional, Sequence

import numpy as np

from sgl_jax.srt.mem_cache.base_prefix_cache import live_namespace
from sgl_jax.srt.mem_cache.free_list import FEW_ROWS
from sgl_jax.srt.mem_cache.req_kv import forget_kv, init_req_kv
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.forward_batch import DecodeRows, ForwardBatch, ForwardMode, ModelWorkerBatch
from sgl_jax.srt.sampling.sampling_batch import STOP_IDS_WIDTH, SamplingBatch, all_allowed_mask
from sgl_jax.srt.sampling.sampling_params import SamplingParams


# ---------------------------------------------------------------- finish reasons (SGLang's JSON shapes)
@dataclasses.dataclass
class FinishReason:
    """Why a request ended; `to_json` gives SGLang's ``meta_info.finish_reason`` object."""

    type: str  # "stop" | "length" | "abort"
    matched: object = None  # token id or stop string for "stop"
    length: Optional[int] = None
    message: Optional[str] = None
    status_code: Optional[int] = None

    def to_json(self) -> dict:
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        out = {"type": "abort", "message": self.message}
        if self.status_code is not None:
            out["status_code"] = self.status_code
        return out


def finish_length(n: int) -> FinishReason:
    return FinishReason("length", length=n)


def finish_abort(message: str, status_code: Optional[int] = None) -> FinishReason:
    return FinishReason("abort", message=message, status_code=status_code)


# ---------------------------------------------------------------- scoring
@dataclasses.dataclass
class ScoreSpec:
    """What a scoring request computes instead of generating (see tokenizer/score_request.py).

    group: the score request (TokenizedScoreReqInput.rid) this sequence belongs to.
    label_token_ids: labels whose log-probabilities (full-vocabulary log-softmax) are returned.
    score_positions: KV positions whose next-token distribution is scored (sorted).
    rope_positions / segment_starts: int32 per position of a packed sequence (rotary positions restart
    after the shared prefix; segment_starts give the mask); None for an ordinary sequence.
    prefix_len: the packed sequence's shared prefix (query) length, 0 otherwise.
    handle: the scoring-cache handle whose query KV this sequence extends (prefill_extend items), or,
    with is_handle_prefill, the handle this query prefill creates.
    label_logprobs: filled in as positions are computed: one list of floats per score position (with
    `pool_index`: the position's final hidden state, float32 [hidden]).
    pool_index: an embedding request's: per score position, the output it is averaged into; None when scoring.
    """

    group: str
    label_token_ids: List[int]
    score_positions: List[int]
    rope_positions: Optional[np.ndarray] = None
    segment_starts: Optional[np.ndarray] = None
    prefix_len: int = 0
    handle: Optional[str] = None
    is_handle_prefill: bool = False
    label_logprobs: List[list] = dataclasses.field(default_factory=list)
    pool_index: Optional[List[int]] = None
    token_types: Optional[np.ndarray] = None  # int32 per position: an encoder's segment A / B (ScoreSeq)


# ---------------------------------------------------------------- request
class Req:
    """One generation request inside the scheduler.

    Token bookkeeping: ``origin_input_ids`` (prompt) + ``output_ids`` (generated) = ``fill_ids``.
    ``num_inflight``: tokens that launched steps are sampling and whose values have not reached the host (0 or 1
    with the overlap scheduler, scheduler/scheduler.py; ``seqlen_ahead`` and ``num_output_total`` count them).
    KV bookkeeping: ``req_pool_idx`` (ReqToTokenPool row, None when released), ``kv_allocated_len``
    (positions with a KV slot) and ``kv_committed_len`` (positions whose K/V are written, as far as the host
    has applied steps).
    """

    def __init__(
        self,
        rid: str,
        origin_input_ids: List[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: List[int],
        seed: int,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        token_ids_logprob: Optional[List[int]] = None,
        stream: bool = False,
        score: Optional[ScoreSpec] = None,
        return_routed_experts: bool = False,
        lora_name: Optional[str] = None,
        lora_uid: Optional[int] = None,
    ):
        self.rid = rid
        # its LoRA adapter (scheduler/lora_control.py): the name, the uid (which keys its prefixes in the radix
        # cache: ``cache_namespace``, mem_cache/cache_manager.py) and, once admitted, its device slot (-1: none)
        self.lora_name = lora_name
        self.cache_namespace = lora_uid
        self.lora_slot = -1
        self.score = score
        # positions whose KV may enter the prefix cache (None: all); a packed scoring sequence shares
        # only its query (none when it has no query: packed embedding inputs).
        packed = score is not None and score.rope_positions is not None
        self.cacheable_len: Optional[int] = score.prefix_len if packed else None
        # prefix KV given at creation (prefill_extend items read the handle's query KV, not the tree's)
        self.fixed_prefix = False
        self.origin_input_ids = list(origin_input_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = set(eos_token_ids)
        self.seed = seed
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.token_ids_logprob = token_ids_logprob
        self.stream = stream
        self.return_routed_experts = return_routed_experts
        self.routed_experts: List[np.ndarray] = []  # per output token: int32 [layers, top-k] (model_runner)
        self.output_ids: List[int] = []
        self.num_inflight = 0  # tokens being sampled by launched steps, not yet appended
        self.finished_reason: Optional[FinishReason] = None
        self.to_abort: Optional[FinishReason] = None

        # KV bookkeeping (req_pool_idx, kv_allocated_len, kv_committed_len, cache_protected_len, last_node,
        # prefix_indices, session_kv, ...): owned by mem_cache (mem_cache/req_kv.py)
        init_req_kv(self)
        self.dp_rank: Optional[int] = None  # the DP rank it must run on (its session's), None: any
        self.extend_input_len = 0  # tokens of the next extend (a chunk, or the whole uncached rest)
        self.is_chunked = False  # between two chunks of its prompt's prefill
        self.cached_tokens = 0
        self.num_retractions = 0

        self.sent_len = 0  # output tokens already sent to the detokenizer
        self.input_logprobs_sent = False
        self.input_token_logprobs: Optional[list] = None
        self.input_top_logprobs: Optional[list] = None
        self.input_token_ids_logprobs: Optional[list] = None
        self.output_token_logprobs: List[tuple] = []
        self.output_top_logprobs: List[list] = []
        self.output_token_ids_logprobs: List[list] = []

        # structured output: the request's Grammar (constrained/grammar_backend.py) once compiled
        self.grammar = None
        self.grammar_future = None
        # the ReqToTokenPool row whose penalty state holds this request's history (None: not set up)
        self.penalty_slot: Optional[int] = None
        # speculative decoding's counts (scheduler/speculative/speculation.SpecCounts) when speculating, else None
        self.spec = None

        self.created_time = time.time()
        stops = sampling_params.stop or []
        self.stop_tail_tokens = 4 * max((len(s) for s in stops), default=0) + 2

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def seqlen_ahead(self) -> int:
        """Tokens including those launched steps are still sampling (the next decode step's position + 1)."""
        return self.seqlen + self.num_inflight

    @property
    def num_output_total(self) -> int:
        """Output tokens including those still being sampled (the step index of the next sample)."""
        return len(self.output_ids) + self.num_inflight

    def done_by_length_ahead(self) -> bool:
        """Whether the tokens in flight take it to max_new_tokens: it finishes by length when they arrive, so the
        next decode step leaves it out."""
        mx = self.sampling_params.max_new_tokens
        return self.num_inflight > 0 and mx is not None and self.num_output_total >= mx

    @property
    def fill_ids(self) -> List[int]:
        return self.origin_input_ids + self.output_ids

    def finished(self) -> bool:
        return self.finished_reason is not None

    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and not self.input_logprobs_sent

    def max_prefix_len(self) -> int:
        """Longest prefix the cache may serve: at least one token is always computed (for its logits),
        and input logprobs need the positions from logprob_start_len - 1 computed."""
        limit = len(self.fill_ids) - 1
        if self.cacheable_len is not None:
            limit = min(limit, self.cacheable_len)
        if self.wants_input_logprobs():
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return limit

    def reset_for_retract(self) -> None:
        """Forget KV state after a retract (KV already released); generation resumes from fill_ids."""
        assert self.req_pool_idx is None, "release the request's KV before resetting it"
        assert self.num_inflight == 0, "apply the request's launched steps before retracting it"
        forget_kv(self)
        self.extend_input_len = 0
        self.is_chunked = False
        self.penalty_slot = None
        self.lora_slot = -1  # (a slot again when readmitted)
        self.cache_namespace = live_namespace(self.cache_namespace)  # (KV of the weights served now)
        if not self.input_logprobs_sent:  # the prompt is prefilled again: its input logprobs are recomputed
            self.input_token_logprobs = self.input_top_logprobs = self.input_token_ids_logprobs = None
        self.num_retractions += 1

    def check_finished(self, decode_tail: Callable[[List[int]], str]) -> None:
        """Set ``finished_reason`` after a new output token (SGLang's order: abort, length, token, string).

        Args:
            decode_tail: decodes a list of token ids to text (for stop-string matching).
        """
        if self.finished_reason is not None:
            return
        if self.to_abort is not None:
            self.finished_reason = self.to_abort
            return
        sp = self.sampling_params
        n = len(self.output_ids)
        if sp.max_new_tokens is not None and n >= sp.max_new_tokens:
            self.finished_reason = finish_length(n)
            return
        if n == 0 or n < sp.min_new_tokens:
            return
        last = self.output_ids[-1]
        if last in sp.stop_token_ids or (not sp.ignore_eos and last in self.eos_token_ids):
            self.finished_reason = FinishReason("stop", matched=last)
            return
        if sp.stop:
            tail = decode_tail(self.output_ids[-self.stop_tail_tokens:])
            for s in sp.stop:
                if s in tail:
                    self.finished_reason = FinishReason("stop", matched=s)
                    return


# ---------------------------------------------------------------- batch
def last_input_token(req: Req) -> int:
    """A decode row's input token: the newest output token (the prompt's last before any), or the placeholder
    ``-(req_pool_idx + 1)`` while a launched step is still sampling it (model_executor/future_tokens.py)."""
    if req.num_inflight:
        return -(req.req_pool_idx + 1)
    return req.output_ids[-1] if req.output_ids else req.origin_input_ids[-1]


def shared_prefix_len(token_rows: np.ndarray, limits: List[int], page_size: int) -> int:
    """Length of the KV prefix that every sequence of an extend batch shares (cascade attention).

    Args:
        token_rows: int32[S, context] the sequences' rows of ReqToTokenPool.req_to_token (KV slot per
            position).
        limits: per sequence, the positions already written before this step (its queries start there),
            capped by its shared-prefix length when it is a packed multi-item sequence.
    Returns:
        The longest n <= min(limits), a multiple of page_size, such that all rows hold the same slots at
        positions [0, n) -- hence the same pages. 0 for an empty batch. Sequences that share a radix-cache
        prefix or a scoring-cache handle (and a single sequence's earlier chunks) give n > 0.
    """
    if len(limits) == 0:
        return 0
    n = min(limits)
    if n <= 0:
        return 0
    head = token_rows[:, :n]
    differ = np.nonzero((head != head[0]).any(axis=0))[0]
    if len(differ):
        n = int(differ[0])
    return n // page_size * page_size


def stop_ids_row(sp: SamplingParams) -> List[int]:
    """The first STOP_IDS_WIDTH stop token ids of a request, -1 padded (what a multi-step decode checks on
    device; the host checks all of them)."""
    ids = list(sp.stop_token_ids or ())[:STOP_IDS_WIDTH]
    return ids + [-1] * (STOP_IDS_WIDTH - len(ids))


def pad_to(a, n: int, dtype=np.int32, value=0) -> np.ndarray:
    """`a` padded with `value` to `n` entries."""
    out = np.full(n, value, dtype)
    out[:len(a)] = a
    return out


def page_table(pool, rows: np.ndarray, s_pad: int, page_size: int) -> np.ndarray:
    """int32[s_pad, pages_per_seq]: the KV page of every page-sized position span of each request's pool row
    (`rows`), zero rows for padding sequences."""
    pages_per_seq = -(-pool.max_context_len // page_size)
    table = np.zeros((s_pad, pages_per_seq), np.int32)
    table[:len(rows)] = pool.req_to_token[rows][:, ::page_size][:, :pages_per_seq] // page_size
    return table


def cumulative_lens(q_lens: np.ndarray, s_pad: int) -> np.ndarray:
    """int32[s_pad + 1]: the cumulative query lengths of len(q_lens) sequences, padding sequences empty."""
    cu = np.zeros(s_pad + 1, np.int32)
    cu[1:len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1:] = cu[len(q_lens)]
    return cu


def step_shape(batches: List[Optional["ScheduleBatch"]], buckets: ShapeBuckets) -> tuple:
    """(mode, T_pad, S_pad) of one step that runs every rank's batch (None: an idle rank): EXTEND when any
    batch extends (decode batches then run as one-token extends), else DECODE; the smallest bucket that
    holds the largest rank's tokens and sequences. One batch gives the bucket it picks alone.

    Raises:
        ValueError: no batch, or no bucket holds them.
    """
    live = [b for b in batches if b is not None and b.reqs]
    if not live:
        raise ValueError("a step needs at least one non-empty batch")
    s = max(len(b.reqs) for b in live)
    if all(b.forward_mode == ForwardMode.DECODE for b in live):
        return (ForwardMode.DECODE, *buckets.decode_shape(s))
    if all(b.forward_mode == ForwardMode.TARGET_VERIFY for b in live):
        return (ForwardMode.TARGET_VERIFY, *buckets.verify_shape(s))
    if any(b.forward_mode == ForwardMode.TARGET_VERIFY for b in live):
        raise ValueError("a verify batch runs with verify batches only (speculation.unify_step makes them so)")
    return (ForwardMode.EXTEND, *buckets.extend_shape(max(b.num_step_tokens() for b in live), s))


class ScheduleBatch:
    """The requests of one forward step and how to lay them out for the model.

    Args:
        reqs: requests in batch order.
        forward_mode: EXTEND (prefill from each request's cached prefix) or DECODE (one token each).

    Mixed chunked prefill (SGLang's ``--enable-mixed-chunk``): an EXTEND batch may also carry running
    requests' decode rows (`mix_with_running`), after its prefill rows; each is a one-token extend of the
    request's last sampled token, and samples the request's next token as a decode step would.

    TARGET_VERIFY (speculative decoding, scheduler/speculative/speculation.py): a decode step whose rows are draft
    trees; ``drafts`` maps id(req) to its tree (tokens int32[n], parents int32[n]; slot 0 the request's last token). A
    request without an entry runs a one-slot tree: its root only, a decode row.

    Multi-step decode (--num-continuous-decode-steps K): a DECODE batch prepared for K steps
    (`prepare_for_decode`) samples up to K tokens per row in one step; ``decode_steps`` maps id(req) to its
    row's number (fewer than K where max_new_tokens comes first; empty: one each).
    """

    def __init__(self, reqs: List[Req], forward_mode: ForwardMode, drafts: Optional[dict] = None):
        self.reqs = reqs
        self.forward_mode = forward_mode
        self.drafts: dict = drafts if drafts is not None else {}
        self._decode_ids: set = set()  # id() of the decode rows of a mixed EXTEND batch
        self.decode_steps: dict = {}  # id(req) -> tokens its row samples (a multi-step decode; absent: 1)
        # set by `launched` (a launched step's own copy), per row: the KV length once the step has run, whether
        # the row samples a token, its index among the step's sequences and its first token in the step
        self.row_ends: Optional[List[int]] = None
        self.row_samples: Optional[List[bool]] = None
        self.row_index: Optional[List[int]] = None
        self.row_token_starts: Optional[List[int]] = None

    def samples(self, req: Req) -> bool:
        """Whether `req`'s row samples a token this step: a decode row, or the chunk that ends its prompt."""
        return self.is_decode_row(req) or req.kv_committed_len + req.extend_input_len >= req.seqlen

    def launched(self) -> "ScheduleBatch":
        """Record that this batch's step was dispatched: returns the step's own copy of the batch (its rows, their
        roles, ``row_ends`` = each row's KV length after the step, ``row_samples`` = the tokens each row samples),
        which the results are applied to (`output.process_batch_result`) -- the running batch may change before they
        arrive -- and counts each sampling row's tokens in ``num_inflight``."""
        out = self.subset(self.reqs)
        out.row_samples = [int(self.samples(r)) * self.decode_steps.get(id(r), 1) for r in self.reqs]
        out.row_ends = [r.kv_allocated_len for r in self.reqs]
        out.row_index = list(range(len(self.reqs)))
        if self.forward_mode == ForwardMode.DECODE:  # (one token a row)
            out.row_token_starts = list(range(len(self.reqs)))
        else:
            lens = [self.row_tokens(r) for r in self.reqs]
            out.row_token_starts = [int(x) for x in np.cumsum([0] + lens[:-1])] if lens else []
        for r, s in zip(self.reqs, out.row_samples):
            r.num_inflight += s
        return out

    def mix_with_running(self, running: List[Req]) -> None:
        """Append running requests as decode rows of this EXTEND batch. Each must have the KV slot of its
        last sampled token allocated and not yet written (`prepare_for_decode`)."""
        assert self.forward_mode == ForwardMode.EXTEND
        for req in running:
            assert req.kv_allocated_len == req.seqlen == req.kv_committed_len + 1, "prepare_for_decode first"
            req.extend_input_len = 1
            self._decode_ids.add(id(req))
        self.reqs = self.reqs + list(running)

    def is_decode_row(self, req: Req) -> bool:
        """Whether `req` runs a decode step in this batch (every row of a DECODE or TARGET_VERIFY batch; the
        mixed-in running requests of an EXTEND batch)."""
        return self.forward_mode != ForwardMode.EXTEND or id(req) in self._decode_ids

    @property
    def num_decode_rows(self) -> int:
        return len(self.reqs) if self.forward_mode != ForwardMode.EXTEND else \
            sum(id(r) in self._decode_ids for r in self.reqs)

    def row_tokens(self, req: Req) -> int:
        """Query tokens of `req`'s row this step: its extend length, its draft tree's slots, or 1."""
        if self.forward_mode == ForwardMode.EXTEND:
            return req.extend_input_len
        draft = self.drafts.get(id(req))
        return 1 if draft is None else len(draft[0])

    def subset(self, reqs: List[Req]) -> "ScheduleBatch":
        """A batch of some of this batch's requests, each in the same role (prefill or decode row)."""
        out = ScheduleBatch(list(reqs), self.forward_mode)
        out._decode_ids = {id(r) for r in reqs if id(r) in self._decode_ids}
        out.drafts = {id(r): self.drafts[id(r)] for r in reqs if id(r) in self.drafts}
        out.decode_steps = {id(r): self.decode_steps[id(r)] for r in reqs if id(r) in self.decode_steps}
        return out

    def drop_finished_rows(self) -> "ScheduleBatch":
        """A launched step's copy without the rows of requests that finished since it was launched (the overlap
        scheduler launches step n+1 before step n's result says who finished): their tokens are dropped (no longer
        in flight), and the positions they wrote were never committed (`release_kv_cache` freed them)."""
        keep = [not r.finished() for r in self.reqs]
        if all(keep):
            return self
        for r, k, s in zip(self.reqs, keep, self.row_samples):
            if not k:
                r.num_inflight -= s
        out = self.subset([r for r, k in zip(self.reqs, keep) if k])
        for name in ("row_ends", "row_samples", "row_index", "row_token_starts"):
            setattr(out, name, [x for x, k in zip(getattr(self, name), keep) if k])
        return out

    def __len__(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    # ---- allocation
    def prepare_for_extend(self, memory) -> None:
        """Give each request a request slot and KV slots for its next ``extend_input_len`` tokens
        (`KVMemory.allocate_extend`, evicting cached KV if needed).

        Raises RuntimeError when the pools run out (admission control must prevent that).
        """
        for req in self.reqs:
            memory.allocate_extend(req)

    def prepare_for_decode(self, memory, num_steps: int = 1) -> bool:
        """One KV slot per request for its last sampled token (`KVMemory.allocate_decode`); requests that
        already have it (taken for a mixed batch that then admitted nothing) are skipped. With `num_steps` K > 1
        (a multi-step decode) each request gets the slots of its next min(K, max_new_tokens left) positions
        (``decode_steps``).

        Returns False (nothing taken) when even eviction cannot free enough pages: the caller retracts.
        """
        if num_steps <= 1:
            self.decode_steps = {}
            return memory.allocate_decode(self.reqs)
        counts = [max(1, min(num_steps, r.sampling_params.max_new_tokens - r.num_output_total)) for r in self.reqs]
        if not memory.allocate_decode(self.reqs, counts):
            return False
        self.decode_steps = {id(r): n for r, n in zip(self.reqs, counts) if n > 1}
        return True

    @property
    def num_steps(self) -> int:
        """Decode steps this batch runs in one program (K of a multi-step decode; 1 otherwise)."""
        return max(self.decode_steps.values(), default=1)

    def filter_finished(self) -> None:
        self.reqs = [r for r in self.reqs if not r.finished()]

    def merge(self, other: "ScheduleBatch") -> None:
        self.reqs.extend(other.reqs)

    # ---- layout
    def num_step_tokens(self) -> int:
        """Tokens this step computes: one per request in decode, the extend lengths in extend, the draft trees'
        slots in a verify step."""
        return sum(self.row_tokens(r) for r in self.reqs)

    def build_model_worker_batch(self, buckets: ShapeBuckets, memory, padded_shape: Optional[tuple] = None,
                                 fill_vocab_mask: bool = True) -> ModelWorkerBatch:
        """Host arrays for the step, padded to the bucket `buckets` picks (see ForwardBatch), or to
        ``padded_shape`` = (step mode, T_pad, S_pad) when the step of several DP ranks is larger (see
        `step_shape`; a decode batch is laid out the same in an EXTEND step: one query token each).
        `memory`: the rank's `KVMemory` (request rows, page size, and the page tables of layers that read another
        pool: `KVMemory.layer_pool_fields`). Without `fill_vocab_mask` the grammar rows are marked ``constrained``
        and their masks left for `vocab_mask` (filled once the step before is applied: scheduler/overlap.py)."""
        reqs = self.reqs
        pool, page_size = memory.req_to_token_pool, memory.page_size
        S = len(reqs)
        if self.forward_mode == ForwardMode.DECODE:
            T = S
            T_pad, S_pad = buckets.decode_shape(S)
            q_lens = np.ones(S, np.int64)
            input_ids = np.array([last_input_token(r) for r in reqs], np.int32)
            positions = np.array([r.seqlen_ahead - 1 for r in reqs], np.int32)
        else:
            q_lens = np.array([r.extend_input_len for r in reqs], np.int64)
            T = int(q_lens.sum())
            T_pad, S_pad = buckets.extend_shape(T, S)
            starts = [r.kv_committed_len for r in reqs]  # KV is written only after the step
            input_ids = np.concatenate([np.asarray(r.fill_ids[s:s + n], np.int32) for r, s, n in
                                        zip(reqs, starts, q_lens)])
            positions = np.concatenate([np.arange(s, s + n, dtype=np.int32) for s, n in zip(starts, q_lens)])
        step_mode = self.forward_mode
        if padded_shape is not None:
            step_mode, T_pad, S_pad = padded_shape
            if T > T_pad or S > S_pad or (step_mode == ForwardMode.DECODE and self.forward_mode != step_mode):
                raise ValueError(f"a {self.forward_mode.name} batch of {T} tokens in {S} sequences does not fit "
                                 f"the step shape {padded_shape}")
        kv_positions = positions.astype(np.int64)
        rows = np.array([r.req_pool_idx for r in reqs], np.int64)
        out_cache_loc = pool.req_to_token[np.repeat(rows, q_lens), kv_positions]
        prefix_lens = np.zeros(S_pad, np.int32)
        segment_starts = np.zeros(T_pad, np.int32)
        packed = [i for i, r in enumerate(reqs) if r.score is not None and r.score.rope_positions is not None]
        if packed and self.forward_mode == ForwardMode.EXTEND:
            offsets = np.concatenate([[0], np.cumsum(q_lens)])
            for i in packed:
                sc, a, b = reqs[i].score, int(offsets[i]), int(offsets[i + 1])
                s0 = reqs[i].kv_committed_len
                positions[a:b] = sc.rope_positions[s0:s0 + b - a]
                segment_starts[a:b] = sc.segment_starts[s0:s0 + b - a]
                prefix_lens[i] = sc.prefix_len
        lora_ids = None
        if any(r.lora_slot >= 0 for r in reqs):  # (else the model runner gives every token -1: no adapter)
            lora_ids = pad_to(np.repeat(np.array([r.lora_slot for r in reqs], np.int32), q_lens), T_pad, value=-1)
        token_types = None
        if any(r.score is not None and r.score.token_types is not None for r in reqs):
            token_types = np.zeros(T_pad, np.int32)  # (an encoder's step: every sequence whole, from 0)
            offsets = np.concatenate([[0], np.cumsum(q_lens)])
            for i, r in enumerate(reqs):
                if r.score is not None and r.score.token_types is not None:
                    s0, a, b = r.kv_committed_len, int(offsets[i]), int(offsets[i + 1])
                    token_types[a:b] = r.score.token_types[s0:s0 + b - a]
        kv_lens = np.array([r.kv_allocated_len for r in reqs], np.int32)
        shared = 0
        if self.forward_mode == ForwardMode.EXTEND:
            limits = [r.kv_committed_len if i not in packed else min(r.kv_committed_len, r.score.prefix_len)
                      for i, r in enumerate(reqs)]
            shared = shared_prefix_len(pool.req_to_token[rows], limits, page_size)
        page_indices = page_table(pool, rows, S_pad, page_size)
        cu = cumulative_lens(q_lens, S_pad)
        pad = pad_to

        fb = ForwardBatch(
            input_ids=pad(input_ids, T_pad),
            positions=pad(positions, T_pad),
            out_cache_loc=pad(out_cache_loc, T_pad),
            cu_q_lens=cu,
            kv_lens=pad(kv_lens, S_pad),
            page_indices=page_indices,
            num_seqs=np.asarray(S, np.int32),
            logits_indices=pad(cu[1:S + 1] - 1, S_pad),
            prefix_lens=prefix_lens,
            segment_starts=segment_starts,
            shared_prefix_len=np.asarray(shared, np.int32),
            token_type_ids=token_types,
            lora_ids=lora_ids,
            forward_mode=step_mode,
        )
        fb = dataclasses.replace(fb, **memory.layer_pool_fields(fb.page_indices, fb.out_cache_loc))
        sampling = self._sampling_batch(input_ids, cu, rows, S_pad, fill_vocab_mask)
        return ModelWorkerBatch(forward_batch=fb, sampling=sampling, num_tokens=T, num_seqs=S)

    def build_decode_rows(self, memory, s_pad: int, num_steps: int = 1) -> DecodeRows:
        """The `DecodeRows` of this DECODE batch (a slot decode reads the rest from the device), padded to `s_pad`
        rows, for `num_steps` steps (the step's K; a row that samples fewer gets KV slot 0 for the rest), filtering
        when a request's sampling filters (`SamplingParams.filters`).
        `memory`: the rank's `KVMemory` (request rows)."""
        reqs = self.reqs
        n = len(reqs)
        table = memory.req_to_token_pool.req_to_token
        filtering = not DecodeRows.has_unfiltered_program(s_pad) or any(r.sampling_params.filters() for r in reqs)
        if num_steps == 1 and n <= FEW_ROWS:  # (scalars: no numpy index iterator; issue #69)
            return DecodeRows.from_rows([(r.req_pool_idx, last_input_token(r), (pos := r.seqlen_ahead - 1),
                                          table[r.req_pool_idx, pos], r.num_output_total, r.grammar is not None)
                                         for r in reqs], s_pad, filtering)
        # one pass over the requests (the step's hot path): slot, position, input token, outputs so far, grammar
        cols = np.array([(r.req_pool_idx, r.seqlen_ahead - 1, last_input_token(r), r.num_output_total,
                          r.grammar is not None) for r in reqs], np.int64).reshape(n, 5).T
        rows, pos = cols[0], cols[1]
        if num_steps == 1:
            kv = table[rows, pos][None]
        else:
            k = np.arange(num_steps)[:, None]
            limit = np.fromiter((self.decode_steps.get(id(r), 1) for r in reqs), np.int64, n)
            kv = np.where(k < limit[None], table[rows[None], np.minimum(pos[None] + k, table.shape[1] - 1)], 0)
        return DecodeRows.build(rows, cols[2], pos, kv, cols[3], cols[4], s_pad, filtering)

    def vocab_mask(self, s_pad: int, samples: Sequence[bool]) -> Optional[np.ndarray]:
        """int32[s_pad, words]: the grammar bitmask of each row that samples (`samples`, per row) and whose
        request has a grammar, from the grammar's state now; every other row all allowed (a request that finished
        since the step was chosen too: its token is dropped). None when no row is constrained."""
        rows = [i for i, (r, s) in enumerate(zip(self.reqs, samples)) if s and r.grammar is not None]
        if not rows:
            return None
        mask = all_allowed_mask(s_pad, self.reqs[rows[0]].grammar.mask_width)
        for i in rows:
            if not self.reqs[i].finished():
                self.reqs[i].grammar.fill_vocab_mask(mask, i)
        return mask

    def _sampling_batch(self, input_ids: np.ndarray, cu: np.ndarray, rows: np.ndarray, S_pad: int,
                        fill_vocab_mask: bool = True) -> SamplingBatch:
        """The step's sampling rows (see SamplingBatch): `input_ids` the step's tokens, `cu` the cumulative query
        lengths, `rows` each request's ReqToTokenPool row; grammar rows are marked ``constrained`` and their
        masks filled now (`vocab_mask`) unless `fill_vocab_mask` is False."""
        reqs = self.reqs
        sps = [r.sampling_params for r in reqs]
        decode_rows = [self.is_decode_row(r) for r in reqs]
        samples = [self.samples(r) for r in reqs]
        constrained = [r.grammar is not None and s for r, s in zip(reqs, samples)]
        vocab_mask = self.vocab_mask(S_pad, samples) if fill_vocab_mask else None
        penalized = [p.uses_penalties() for p in sps]
        # a decode row's input is its newest output token: the penalty counts take it in (once)
        last_index = [r.num_output_total - 1 if d else -1 for r, d in zip(reqs, decode_rows)]
        last_token = [input_ids[cu[i + 1] - 1] if d else 0 for i, d in enumerate(decode_rows)]
        return SamplingBatch.build(sps, {
            "seeds": [r.seed for r in reqs],
            "steps": [r.num_output_total for r in reqs],
            "suppress_eos": [r.num_output_total < p.min_new_tokens for r, p in zip(reqs, sps)],
            "slots": rows,
            "penalized": penalized,
            "last_token": last_token,
            "last_token_index": last_index,
            "writes_future": samples,
            "constrained": constrained,
            "min_new_tokens": [p.min_new_tokens for p in sps],
            "ignore_eos": [p.ignore_eos for p in sps],
            "stop_ids": [stop_ids_row(p) for p in sps],
        }, S_pad, vocab_mask)
