"""Prefill admission: which waiting requests join the next extend batch (first come, first served).

A request is admitted when, together with the ones already picked,
- its extend tokens fit the step's token budget: --chunked-prefill-size when chunking (the last admitted
  request may be cut to a page-aligned chunk and continue next step), else --max-prefill-tokens (a lone
  request may use the largest bucket); and some compiled extend bucket holds the batch;
- running + admitted requests stay within --max-running-requests and the ReqToTokenPool;
- the KV pool (free pages plus evictable cached pages) holds its uncached prompt plus an estimate of the
  tokens it will generate: ``new_token_ratio * max_new_tokens``, the same estimate being reserved for
  every running request. The ratio starts at 0.7 and decays to 0.1 while decoding goes well; when decode
  runs out of pages anyway, requests are retracted and the ratio is raised (SGLang's scheme).

With mixed chunked prefill the running requests' decode rows ride in the batch: each takes one token of the
budget and one sequence of the bucket (`decode_rows`). While requests decode, --max-prefill-step-ms may cut
the budget further (`token_limit`, from scheduler/step_budget.py).

Sliding-window models with a separate SWA pool (hybrid SWA memory) are admitted against both pools: the
full pool as above (free plus evictable), and the SWA pool (free plus SWA-evictable) for each request's peak
SWA use, ``window + interval + 2 pages``
(interval: the tokens one step adds, a chunk or the whole prompt when prefilled at once; never more than the
request's final length), minus the SWA pages a running request already holds (SGLang's accounting).

Admitting a request locks its matched prefix in the prefix cache (those pages stop being evictable);
a rejected request's lock is released at once.
"""

from __future__ import annotations

import math
from typing import List, Optional

from sgl_jax.srt.scheduler.schedule_batch import Req
from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.cache_manager import match_req, own_swa_pages
from sgl_jax.srt.model_executor.buckets import ShapeBuckets

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600  # per decode step
CLIP_MAX_NEW_TOKENS = 4096  # estimates never assume more future tokens than this per request
RETRACT_DECODE_STEPS = 20  # after a retract, reserve room for this many more decode steps of every request


def future_tokens(req: Req, ratio: float) -> int:
    """Estimated tokens `req` will still generate."""
    remaining = req.sampling_params.max_new_tokens - len(req.output_ids)
    return math.ceil(min(max(remaining, 0), CLIP_MAX_NEW_TOKENS) * ratio)


def swa_peak_tokens(req: Req, window: int, interval: int, page_size: int, ratio: float) -> int:
    """Most SWA KV tokens `req` holds at once when its SWA KV is freed as it leaves the window: the window,
    one step's tokens and two pages of slack, or its whole (estimated) length if shorter."""
    return min(req.seqlen + future_tokens(req, ratio), window + interval + 2 * page_size)


def ratio_after_retract(running: List[Req]) -> float:
    """SGLang's estimate after a retract: room for RETRACT_DECODE_STEPS more tokens of each request."""
    decoded = sum(len(r.output_ids) for r in running)
    total = sum(r.sampling_params.max_new_tokens for r in running)
    return min(1.0, (decoded + RETRACT_DECODE_STEPS * len(running)) / max(total, 1))


class PrefillAdder:
    """Accumulates admissible requests for one extend batch.

    Args:
        buckets: compiled shapes (the batch must fit one).
        allocator: KV allocator; tree_cache: the prefix cache (match, lock, evictable size).
        running: requests currently decoding (their future tokens are reserved).
        max_prefill_tokens: token budget without chunking; chunk_size: token budget with chunking (None: off).
        free_req_slots: free ReqToTokenPool slots (a streaming session's turn needs none: it runs in the
            session's); free_running: requests that may still join the running ones (--max-running-requests;
            None: free_req_slots).
        new_token_ratio: the current future-token estimate factor.
        swa_window: the sliding window when the allocator has a separate SWA pool (`SWAPagedAllocator`),
            else None.
        swa_release: running requests' SWA KV is freed as it leaves the window (else a request holds SWA KV
            for its whole length, and admission reserves that).
        decode_rows: running requests whose decode rows ride in this batch (mixed chunked prefill): each takes
            one token of the step's budget and one sequence of its bucket.
        token_limit: at most this many prefill tokens in this step (the --max-prefill-step-ms chunk limit, decode
            rows not counted; None: no limit).
    """

    def __init__(self, buckets: ShapeBuckets, allocator: PagedTokenToKVPoolAllocator, tree_cache,
                 running: List[Req], *, max_prefill_tokens: int, chunk_size: Optional[int], free_req_slots: int,
                 new_token_ratio: float, swa_window: Optional[int] = None,
                 swa_release: bool = True, free_running: Optional[int] = None, decode_rows: int = 0,
                 token_limit: Optional[int] = None):
        self.buckets = buckets
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.ps = allocator.page_size
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_size = chunk_size
        self.ratio = new_token_ratio
        self.free_req_slots = free_req_slots
        self.free_running = free_req_slots if free_running is None else free_running
        self.swa_window = swa_window
        self.swa_release = swa_release
        self.decode_rows = decode_rows
        self.token_limit = token_limit
        full_free = allocator.full_available_pages() if swa_window else allocator.available_pages()
        self.rem_pages = (full_free + tree_cache.evictable_size() // self.ps
                          - sum(self._pages(future_tokens(r, self.ratio)) for r in running))
        if swa_window:
            self.rem_swa_pages = allocator.swa_available_pages() + tree_cache.swa_evictable_size() // self.ps - sum(
                max(0, self._swa_peak_pages(r, 1) - own_swa_pages(r, self.ps)) for r in running)
        self.can_run: List[Req] = []
        self.num_tokens = 0
        self.new_chunked_req: Optional[Req] = None  # a request cut to a chunk in this batch

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.ps)

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

    def _take(self, req: Req, extend: int) -> int:
        """Tokens of `req` this batch can extend (page-aligned when cut), or 0."""
        room = self._budget() - self.num_tokens
        if extend <= room:
            return extend
        if self.chunk_size is None:
            return 0
        return room // self.ps * self.ps

    def add_chunked(self, req: Req) -> bool:
        """Continue a request whose prompt is being prefilled in chunks (always first in the batch)."""
        remaining = req.seqlen - req.kv_committed_len
        n = self._take(req, remaining)
        pages = self.allocator.pages_needed(req.kv_allocated_len, req.kv_committed_len + n)
        self.rem_pages -= self.allocator.pages_needed(req.kv_allocated_len, req.seqlen) + \
            self._pages(future_tokens(req, self.ratio))
        available_now = self._available_pages_now()
        if n == 0 or pages > available_now or not self._fits_bucket(n):
            return False
        if self.swa_window:
            self.rem_swa_pages -= max(0, self._swa_peak_pages(req, n) - own_swa_pages(req, self.ps))
        self._accept(req, n, remaining)
        return True

    def add(self, req: Req) -> bool:
        """Admit a waiting request if everything fits; returns False (and admits nothing) otherwise."""
        session = req.session_kv if req.session_kv is not None and req.session_kv.has_kv() else None
        if self.new_chunked_req is not None or self.free_running <= 0 or (self.free_req_slots <= 0 and
                                                                          session is None):
            return False
        swa_before = self.tree_cache.swa_evictable_size()
        match, moved = match_req(req, self.tree_cache)  # locked; a prefill_extend item reuses its handle's KV
        swa_moved = swa_before - self.tree_cache.swa_evictable_size()  # the lock's window, SWA pool
        try:
            prefix = match.length
            extend = len(req.fill_ids) - prefix
            n = self._take(req, extend)
            need = self.allocator.pages_needed(prefix, req.seqlen) + self._pages(future_tokens(req, self.ratio))
            fits = n > 0 and self._fits_bucket(self.num_tokens + n) and need <= self.rem_pages - moved // self.ps
            swa_need = 0
            if self.swa_window:  # (a session's turn already holds the session's SWA pages)
                held = session.held_swa_tokens(self.ps) // self.ps if session is not None else 0
                swa_need = max(0, self._swa_peak_pages(req, n) - held)
            fits = fits and (not self.swa_window or swa_need <= self.rem_swa_pages - swa_moved // self.ps)
            if session is not None:  # its first extend's pages must be there now (its window is already held)
                fits = fits and self.allocator.pages_needed(prefix, prefix + n) <= self._available_pages_now()
        except BaseException:  # never leave the prefix locked
            self.tree_cache.dec_lock_ref(match.last_node)
            raise
        if not fits:
            self.tree_cache.dec_lock_ref(match.last_node)
            return False
        self.rem_pages -= need + moved // self.ps
        if self.swa_window:
            self.rem_swa_pages -= swa_need + swa_moved // self.ps
        self.free_running -= 1
        if session is None:  # (a session's turn runs in the session's request slot)
            self.free_req_slots -= 1
        req.prefix_indices = match.device_indices
        req.last_node = match.last_node
        if req.num_retractions == 0 and not req.output_ids:
            req.cached_tokens = prefix
        self._accept(req, n, extend)
        return True

    def _available_pages_now(self) -> int:
        """Pages an allocation could get now: free plus evictable (in both pools with hybrid SWA memory)."""
        if not self.swa_window:
            return self.allocator.available_pages() + self.tree_cache.evictable_size() // self.ps
        full = self.allocator.full_available_pages() + self.tree_cache.evictable_size() // self.ps
        return min(full, self.allocator.swa_available_pages() + self.tree_cache.swa_evictable_size() // self.ps)

    def _swa_peak_pages(self, req: Req, n: int) -> int:
        """Peak SWA pages of a request extending n tokens per step (a chunk, or its whole prompt)."""
        if not self.swa_release:
            return self._pages(req.seqlen + future_tokens(req, self.ratio))
        interval = n if n == 1 or self.chunk_size is None else self.chunk_size
        return self._pages(swa_peak_tokens(req, self.swa_window, interval, self.ps, self.ratio))

    def _accept(self, req: Req, n: int, remaining: int) -> None:
        req.extend_input_len = n
        self.num_tokens += n
        self.can_run.append(req)
        if n < remaining:
            self.new_chunked_req = req
