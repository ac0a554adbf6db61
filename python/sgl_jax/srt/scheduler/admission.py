"""Admission: the one policy that decides which waiting requests join a rank's next extend batch.

`AdmissionPolicy.admit` decides, in one place:

- **order**: the chunked request first; then the items of live scoring-cache handles (they free their handle's
  slot and KV), then generation requests (arrival order, or with --schedule-policy lpm the longest cached prefix
  first), then new scoring work (`admission_order`); admission stops at the first request that does not fit;
- **fit**: a request is admitted when, together with the ones already picked,
  - its extend tokens fit the step's token budget: --chunked-prefill-size when chunking (the last admitted
    request may be cut to a page-aligned chunk and continue next step), else --max-prefill-tokens (a lone
    request may use the largest bucket); and some compiled extend bucket holds the batch;
  - running + admitted requests stay within --max-running-requests and the ReqToTokenPool;
  - the KV memory holds its uncached prompt plus an estimate of the tokens it will generate:
    ``new_token_ratio * max_new_tokens``, the same estimate being reserved for every running request
    (`mem_cache/kv_memory.KVBudget` counts the pages, in every pool). The ratio starts at 0.7 and decays to
    0.1 while decoding goes well; when decode runs out of pages anyway, requests are retracted and the ratio
    is raised (SGLang's scheme);
- **the scoring-handle reserve** (`HandleRoom`): a new handle's query is skipped, not waited for, while at most
  max_running_requests / 2 live handles hold at most half the KV pool, so their items always find slots;
- **the prefill step budget** (--max-prefill-step-ms, scheduler/step_budget.py): while requests decode, the
  chunk is cut so that the step adds at most the budget to their inter-token latency;
- **the bucket cut** (`ShapeBuckets.extend_cut`, with chunking and without mixed decode rows): a batch just
  above a token bucket runs a smaller bucket's worth of tokens now and the rest next step when that computes
  fewer padded tokens by more than the smallest bucket (`PrefillAdder.trim`).

With mixed chunked prefill the running requests' decode rows ride in the batch: each takes one token of the
budget and one sequence of the bucket (`decode_rows`).

Admitting a request locks its matched prefix in the prefix cache (those pages stop being evictable); a
rejected request's lock is released at once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

from sgl_jax.srt import fault_injection
from sgl_jax.srt.mem_cache.kv_memory import KVBudget, KVMemory, PrefixMatch
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.scheduler.schedule_batch import Req
from sgl_jax.srt.scheduler.step_budget import PrefillStepBudget

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600  # per decode step
CLIP_MAX_NEW_TOKENS = 4096  # estimates never assume more future tokens than this per request
RETRACT_DECODE_STEPS = 20  # after a retract, reserve room for this many more decode steps of every request


def future_tokens(req: Req, ratio: float) -> int:
    """Estimated tokens `req` will still generate."""
    remaining = req.sampling_params.max_new_tokens - len(req.output_ids)
    return math.ceil(min(max(remaining, 0), CLIP_MAX_NEW_TOKENS) * ratio)


def ratio_after_retract(running: List[Req]) -> float:
    """SGLang's estimate after a retract: room for RETRACT_DECODE_STEPS more tokens of each request."""
    decoded = sum(len(r.output_ids) for r in running)
    total = sum(r.sampling_params.max_new_tokens for r in running)
    return min(1.0, (decoded + RETRACT_DECODE_STEPS * len(running)) / max(total, 1))


def is_handle_prefill(req: Req) -> bool:
    return req.score is not None and req.score.is_handle_prefill


LPM_MAX_WAITING = 128  # lpm orders at most this many waiting requests (SGLang's threshold); fcfs beyond


def by_policy(reqs: List[Req], policy: str, memory: KVMemory) -> List[Req]:
    """Generation requests in the order --schedule-policy gives: "fcfs" keeps arrival order; "lpm" puts the
    longest reusable prefix the prefix cache holds first (`KVMemory.prefix_match_len` of what admission may
    match, ``fill_ids[:max_prefix_len()]``; read-only), arrival order among equals, and falls back to arrival
    order beyond LPM_MAX_WAITING requests (the matching would cost more than it saves). A streaming session's
    turn is ranked by the prefix cache too, not by its session's KV."""
    if policy == "fcfs" or len(reqs) > LPM_MAX_WAITING:
        return reqs
    return sorted(reqs, key=lambda r: -memory.prefix_match_len(r.fill_ids[:r.max_prefix_len()], r.cache_namespace))


def admission_order(waiting: List[Req], scoring, policy: str = "fcfs", memory: Optional[KVMemory] = None
                    ) -> List[Req]:
    """`waiting` in admission order: the items of live handles (they free their handle's slot and KV), then
    generation requests (in --schedule-policy order, `by_policy`), then new scoring work; queue order within the
    others. `scoring`: the rank's `SchedulerScoring` (its live groups and handles)."""
    if policy == "fcfs" and not scoring.groups and not scoring.handles:
        return waiting
    live_items, generation, new_scoring = [], [], []
    for r in waiting:
        if r.score is None:
            generation.append(r)
        elif not r.score.is_handle_prefill and r.score.handle is not None and r.score.handle in scoring.handles:
            live_items.append(r)
        else:
            new_scoring.append(r)
    return live_items + by_policy(generation, policy, memory) + new_scoring


@dataclasses.dataclass
class HandleRoom:
    """What new scoring-cache handles may still take in one admission round.

    live / held_tokens: handles alive or being prefilled, and their query tokens. A handle's query is
    admitted when none is live (one handle and its items always fit: every scored sequence fits the pool),
    else while fewer than `max_handles` are live and their queries stay within `max_tokens`.
    """

    live: int
    held_tokens: int
    max_handles: int
    max_tokens: int

    @classmethod
    def of(cls, scoring, chunked_req: Optional[Req], max_running_requests: int, kv_size: int) -> "HandleRoom":
        """The reserve for the next round: `scoring`'s live handles, plus `chunked_req` when it is a handle's
        query being chunk-prefilled; at most max_running_requests / 2 handles holding half of `kv_size`."""
        live = len(scoring.handles)
        held = sum(len(h.req.origin_input_ids) for h in scoring.handles.values())
        if chunked_req is not None and is_handle_prefill(chunked_req):
            live += 1
            held += len(chunked_req.origin_input_ids)
        return cls(live, held, max(1, max_running_requests // 2), kv_size // 2)

    def admits(self, req: Req) -> bool:
        if self.live == 0:
            return True
        return self.live < self.max_handles and self.held_tokens + len(req.origin_input_ids) <= self.max_tokens

    def take(self, req: Req) -> None:
        self.live += 1
        self.held_tokens += len(req.origin_input_ids)


class PrefillAdder:
    """Accumulates admissible requests for one extend batch: the token budget and buckets here, the pages in
    the KV memory's `KVBudget`.

    Args:
        buckets: compiled shapes (the batch must fit one).
        memory: the rank's `KVMemory`.
        running: requests currently decoding (their future tokens are reserved).
        max_prefill_tokens: token budget without chunking; chunk_size: token budget with chunking (None: off).
        free_req_slots: free ReqToTokenPool slots (a streaming session's turn needs none: it runs in the
            session's); free_running: requests that may still join the running ones (--max-running-requests;
            None: free_req_slots).
        new_token_ratio: the current future-token estimate factor.
        decode_rows: running requests whose decode rows ride in this batch (mixed chunked prefill): each takes
            one token of the step's budget and one sequence of its bucket.
        token_limit: at most this many prefill tokens in this step (the --max-prefill-step-ms chunk limit, decode
            rows not counted; None: no limit).
    """

    def __init__(self, buckets: ShapeBuckets, memory: KVMemory, running: List[Req], *, max_prefill_tokens: int,
                 chunk_size: Optional[int], free_req_slots: int, new_token_ratio: float,
                 free_running: Optional[int] = None, decode_rows: int = 0, token_limit: Optional[int] = None):
        self.buckets = buckets
        self.ps = memory.page_size
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_size = chunk_size
        self.ratio = new_token_ratio
        self.free_req_slots = free_req_slots
        self.free_running = free_req_slots if free_running is None else free_running
        self.decode_rows = decode_rows
        self.token_limit = token_limit
        self.kv: KVBudget = memory.budget([(r, future_tokens(r, self.ratio)) for r in running], chunk_size)
        self.can_run: List[Req] = []
        self.num_tokens = 0
        self.new_chunked_req: Optional[Req] = None  # a request cut to a chunk in this batch
        # id(req) -> (its locked prefix, its prefix_indices, last_node and cached_tokens before `add`): `trim`
        # releases the lock of a request it drops and gives it back the fields of a waiting request
        self._admitted: Dict[int, Tuple[PrefixMatch, object, object, int]] = {}

    def _budget(self) -> int:
        if self.chunk_size is not None:
            budget = self.chunk_size
        else:
            budget = self.max_prefill_tokens if self.can_run else self.buckets.max_tokens
        budget -= self.decode_rows
        return budget if self.token_limit is None else min(budget, self.token_limit)

    def _fits_bucket(self, tokens: int) -> bool:
        try:
            self.buckets.extend_shape(tokens + self.decode_rows, len(self.can_run) + 1 + self.decode_rows)
            return True
        except ValueError:
            return False

    def _take(self, extend: int) -> int:
        """Tokens of a request this batch can extend (page-aligned when cut), or 0."""
        room = self._budget() - self.num_tokens
        if extend <= room:
            return extend
        if self.chunk_size is None:
            return 0
        return room // self.ps * self.ps

    def add_chunked(self, req: Req) -> bool:
        """Continue a request whose prompt is being prefilled in chunks (always first in the batch)."""
        remaining = req.seqlen - req.kv_committed_len
        n = self._take(remaining)
        fits = self.kv.reserve_chunk(req, n, future_tokens(req, self.ratio))
        if n == 0 or not fits or not self._fits_bucket(n):
            return False
        self._accept(req, n, remaining)
        return True

    def add(self, req: Req) -> bool:
        """Admit a waiting request if everything fits; returns False (and admits nothing) otherwise."""
        session = req.session_kv is not None and req.session_kv.has_kv()
        if self.new_chunked_req is not None or self.free_running <= 0 or (self.free_req_slots <= 0 and not session):
            return False
        m = self.kv.match(req)  # locked; a prefill_extend item reuses its handle's KV
        try:
            extend = len(req.fill_ids) - m.length
            n = self._take(extend)
            fits = n > 0 and self._fits_bucket(self.num_tokens + n) and \
                self.kv.reserve(req, m, n, future_tokens(req, self.ratio))
        except BaseException:  # never leave the prefix locked
            self.kv.unlock(m)
            raise
        if not fits:
            self.kv.unlock(m)
            return False
        self.free_running -= 1
        if not session:  # (a session's turn runs in the session's request slot)
            self.free_req_slots -= 1
        self._admitted[id(req)] = (m, req.prefix_indices, req.last_node, req.cached_tokens)
        req.prefix_indices = m.match.device_indices
        req.last_node = m.match.last_node
        if req.num_retractions == 0 and not req.output_ids:
            req.cached_tokens = m.length
        self._accept(req, n, extend)
        return True

    def _accept(self, req: Req, n: int, remaining: int) -> None:
        req.extend_input_len = n
        self.num_tokens += n
        self.can_run.append(req)
        if n < remaining:
            self.new_chunked_req = req

    def trim(self, tokens: int) -> bool:
        """Keep only the batch's first `tokens` extend tokens (chunking only): the request that crosses them is cut
        there, page-aligned (it becomes the chunked request and goes on next step), the requests after it leave
        the batch (their prefix locks released and the fields `add` set given back: they stay waiting as before).
        Returns False, changing nothing, when the cut would leave the first request no page or `tokens` holds the
        whole batch."""
        if self.chunk_size is None or tokens >= self.num_tokens:
            return False
        kept, before = 0, 0
        for req in self.can_run:
            if before + req.extend_input_len > tokens:
                break
            kept, before = kept + 1, before + req.extend_input_len
        cut = self.can_run[kept]
        take = (tokens - before) // self.ps * self.ps
        if kept == 0 and take == 0:
            return False
        end = kept + (1 if take else 0)
        for req in self.can_run[end:]:  # (never the first request: the only one `add_chunked` may have added)
            m, req.prefix_indices, req.last_node, req.cached_tokens = self._admitted.pop(id(req))
            self.kv.unlock(m)
        self.can_run = self.can_run[:end]
        self.new_chunked_req = None
        if take:
            cut.extend_input_len = take
            self.new_chunked_req = cut
        self.num_tokens = sum(r.extend_input_len for r in self.can_run)
        return True


@dataclasses.dataclass
class Admission:
    """What one admission round decided: `can_run` joins the extend batch (in order; `new_chunked_req`, if
    any, was cut to a chunk), `failed` could not be scheduled at all ((req, exception): the rank fails them),
    `token_limit` the step budget's chunk limit it ran under (None: none)."""

    can_run: List[Req]
    new_chunked_req: Optional[Req]
    failed: List[Tuple[Req, BaseException]]
    token_limit: Optional[int] = None


class AdmissionPolicy:
    """The admission policy of one rank (see the module docstring): order, fit, the scoring-handle reserve and
    the prefill step budget, behind `admit`.

    Args:
        buckets, max_running_requests, max_prefill_tokens, chunk_size: the rank's limits.
        memory: the rank's `KVMemory`; scoring: its `SchedulerScoring` (live handles and groups).
        step_budget: the --max-prefill-step-ms chunk limit (None: chunks are --chunked-prefill-size; ignored
            without chunking).
        schedule_policy: --schedule-policy ("fcfs" or "lpm", `by_policy`).
        lora: the scheduler's `SchedulerLora` (--enable-lora), which gives a request with an adapter its device slot
            before it is admitted; None: no LoRA.

    It also keeps the future-token estimate factor (``new_token_ratio``, SGLang's): INIT_NEW_TOKEN_RATIO at start,
    lowered by NEW_TOKEN_RATIO_DECAY per decode step (`on_decode_step`) down to MIN_NEW_TOKEN_RATIO, and reset
    after a retract to what the running requests need (`on_retract`).
    """

    def __init__(self, *, buckets: ShapeBuckets, max_running_requests: int, max_prefill_tokens: int,
                 chunk_size: Optional[int], memory: KVMemory, scoring,
                 step_budget: Optional[PrefillStepBudget] = None, schedule_policy: str = "fcfs", lora=None):
        self.schedule_policy = schedule_policy
        self.lora = lora
        self.buckets = buckets
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_size = chunk_size
        self.memory = memory
        self.scoring = scoring
        self.step_budget = step_budget if chunk_size is not None else None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_bucket_cuts = 0  # extend batches cut at a smaller bucket (`ShapeBuckets.extend_cut`)

    def on_decode_step(self) -> None:
        """A decode step ran (alone or mixed into a prefill step): the estimate decays."""
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)

    def on_retract(self, running: List[Req]) -> None:
        """The rank retracted requests; `running` are those left: reserve room for their next decode steps."""
        self.new_token_ratio = ratio_after_retract(running)

    def token_limit(self, running: List[Req], chunked_req: Optional[Req], mixed: bool) -> Optional[int]:
        """The --max-prefill-step-ms chunk limit for the next prefill step (None: no limit)."""
        if self.step_budget is None or not running:
            return None
        prefix = chunked_req.kv_committed_len if chunked_req is not None else 0
        return self.step_budget.chunk_limit(self.chunk_size, prefix, [r.seqlen for r in running], mixed)

    def admit(self, waiting: List[Req], running: List[Req], chunked_req: Optional[Req],
              mixed: bool = False) -> Optional[Admission]:
        """Which requests join the next extend batch: the chunked request first, then `waiting` in admission
        order, stopping at the first that does not fit; a new handle's query is skipped while the handle
        reserve is used up. `mixed`: the running requests' decode rows ride in the batch.

        Returns None when the chunked request's next chunk cannot run (nothing else is admitted then). A request
        whose admission raises is returned in ``failed`` (the fault-injection "schedule" stage raises here too),
        the others go on. The step budget counts a limited step only when something was admitted.
        """
        in_flight = len(running) + (1 if chunked_req is not None else 0)
        limit = self.token_limit(running, chunked_req, mixed)
        adder = PrefillAdder(self.buckets, self.memory, running, max_prefill_tokens=self.max_prefill_tokens,
                             chunk_size=self.chunk_size, free_req_slots=self.memory.free_req_slots(),
                             free_running=self.max_running_requests - in_flight, new_token_ratio=self.new_token_ratio,
                             decode_rows=len(running) if mixed else 0, token_limit=limit)
        if chunked_req is not None and not adder.add_chunked(chunked_req):
            return None
        room = HandleRoom.of(self.scoring, chunked_req, self.max_running_requests, self.memory.size)
        failed = []
        for req in admission_order(waiting, self.scoring, self.schedule_policy, self.memory):
            handle = is_handle_prefill(req)
            if handle and not room.admits(req):
                continue
            try:
                fault_injection.check("schedule", (req.rid,))
                # a LoRA request needs its adapter in a device slot first (every slot busy: it waits, and the
                # requests after it may still go, as in SGLang)
                if req.lora_name is not None and not self.lora.place(req, adder.can_run):
                    continue
                admitted = adder.add(req)
            except Exception as exc:  # this request cannot be scheduled: fail it, go on with the others
                failed.append((req, exc))
                continue
            if not admitted:
                break
            if handle:
                room.take(req)
        if adder.can_run and self.chunk_size is not None and not mixed:
            # less padding: a smaller bucket's worth of tokens now and the rest next step (ShapeBuckets.extend_cut)
            cut = self.buckets.extend_cut(adder.num_tokens, self.memory.page_size)
            if cut is not None and adder.trim(cut):
                self.num_bucket_cuts += 1
        if adder.can_run and self.step_budget is not None:
            self.step_budget.record_step(limit, self.chunk_size)
        return Admission(adder.can_run, adder.new_chunked_req, failed, limit)
