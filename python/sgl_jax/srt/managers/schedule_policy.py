"""Prefill admission: which waiting requests join the next extend batch (first come, first served).

A request is admitted when, together with the ones already picked,
- its extend tokens fit the prefill budget (--max-prefill-tokens; a lone request may use the largest
  token bucket) and some compiled extend bucket holds the batch,
- running + admitted requests stay within --max-running-requests and the ReqToTokenPool,
- the KV pool can hold every admitted request's prompt and all tokens it may still generate, after the
  same reservation for every running request. Decode therefore never runs out of pages.
"""

from __future__ import annotations

from typing import List

from sgl_jax.srt.managers.schedule_batch import Req
from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sgl_jax.srt.model_executor.buckets import ShapeBuckets


def final_len(req: Req) -> int:
    """Tokens of KV the request may hold when it finishes (prompt + max_new_tokens)."""
    return len(req.origin_input_ids) + req.sampling_params.max_new_tokens


def reserved_pages(reqs: List[Req], allocator: PagedTokenToKVPoolAllocator) -> int:
    """Pages running requests may still take before they finish."""
    return sum(allocator.pages_needed(r.kv_allocated_len, final_len(r)) for r in reqs)


class PrefillAdder:
    """Accumulates admissible requests for one extend batch.

    Args:
        buckets: compiled shapes (an extend batch must fit one).
        allocator: KV allocator (free pages).
        running: requests currently decoding.
        max_prefill_tokens: prefill token budget.
        free_req_slots: request slots left (min of ReqToTokenPool and --max-running-requests room).
    """

    def __init__(self, buckets: ShapeBuckets, allocator: PagedTokenToKVPoolAllocator, running: List[Req],
                 max_prefill_tokens: int, free_req_slots: int):
        self.buckets = buckets
        self.allocator = allocator
        self.max_prefill_tokens = max_prefill_tokens
        self.free_pages = allocator.available_pages() - reserved_pages(running, allocator)
        self.free_req_slots = free_req_slots
        self.can_run: List[Req] = []
        self.num_tokens = 0

    def add(self, req: Req) -> bool:
        """Admit `req` if everything fits; returns False (and admits nothing) otherwise."""
        extend = req.seqlen - req.prefix_len
        tokens = self.num_tokens + extend
        budget = self.max_prefill_tokens if self.can_run else self.buckets.max_tokens
        if self.free_req_slots <= 0 or tokens > budget:
            return False
        try:
            self.buckets.extend_shape(tokens, len(self.can_run) + 1)
        except ValueError:
            return False
        pages = self.allocator.pages_needed(req.prefix_len, final_len(req))
        if pages > self.free_pages:
            return False
        self.free_pages -= pages
        self.free_req_slots -= 1
        self.num_tokens = tokens
        self.can_run.append(req)
        return True
