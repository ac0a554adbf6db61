"""KVMemory: one DP rank's KV memory behind one object (vLLM's KV cache manager plays this part).

It owns the rank's `ReqToTokenPool`, its paged allocator (full pool, plus the SWA pool of hybrid sliding-window
memory), its prefix cache (a kind from `registry`), the accounting and the out-of-window SWA release, and it
answers the scheduler's questions about memory: what an admission round may still promise (`KVBudget`),
whether a request's next step can be allocated (`allocate_decode` answers False when even eviction leaves too
few pages, so the rank retracts -- vLLM's ``allocate_slots`` answers None; `allocate_extend` gets what admission
reserved, or raises), how much is free, cached or held,
and whether every page has exactly one owner. The scheduler never reads the allocators or the cache itself,
and the sliding window is known here and in the models only.

The device buffers are not built here: `plan_kv_cache` describes them as a `KVCacheSpec` (pools, pages, which
layer reads which pool), which the model runner allocates and this object mirrors on the host.

Speculative decoding: a verify step's draft slots are extra positions of the request (`allocate_drafts`), and
the unaccepted ones are given back by a trim of the request's own positions (`rollback`, `session_kv.trim_kv`).
Room is left for adapter-keyed prefixes (LoRA): a cache kind whose keys carry the adapter.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from sgl_jax.srt.fault_injection import PlantedFaults
from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.base_prefix_cache import MatchResult
from sgl_jax.srt.mem_cache.cache_manager import cache_unfinished_req, match_req, own_swa_pages, \
    release_swa_out_of_window
from sgl_jax.srt.mem_cache.common import alloc_with_evict, evict_for_pages, release_kv_cache
from sgl_jax.srt.mem_cache.free_list import FEW_ROWS
from sgl_jax.srt.mem_cache.hi_radix_cache import HostTier
from sgl_jax.srt.mem_cache.kv_invariants import check_kv_invariants
from sgl_jax.srt.mem_cache.registry import cache_kind_for, create_prefix_cache
from sgl_jax.srt.mem_cache.req_state import ReqRowsPool, ReqRowsSpec, ReqStatePool, ReqStateSpec
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sgl_jax.srt.mem_cache.session_kv import SessionKV, trim_kv
from sgl_jax.srt.mem_cache.swa_allocator import SWAPagedAllocator, split_hybrid_budget

FULL_POOL, SWA_POOL = 0, 1
# Keep every running request's SWA KV until it finishes (hybrid SWA memory without SWA release): for measuring
# what SWA release buys, not for serving.
DISABLE_SWA_RELEASE_ENV = "SGL_JAX_DISABLE_SWA_RELEASE"


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """The KV buffers of one rank, as the model runner allocates them.

    page_size: tokens per page. pool_tokens: usable tokens of each pool (pool 0 holds full-attention layers; pool
    1, with hybrid SWA memory, the sliding-window layers); each pool's buffers have one more page per rank, page
    0, the padding sink. layer_pool: the pool of each layer's K and V buffers. sliding_window: the window (tokens)
    of the layers that read the SWA pool; None without one (KV outside it is released, `KVMemory.after_step`).
    """

    page_size: int
    pool_tokens: Tuple[int, ...]
    layer_pool: Tuple[int, ...]
    sliding_window: Optional[int] = None
    req_states: Tuple[ReqStateSpec, ...] = ()  # per-request state beyond KV (req_state.py), a slot per request
    req_rows: Tuple[ReqRowsSpec, ...] = ()  # per-request rows (req_state.py: a vision tower's embeddings)

    @property
    def num_pools(self) -> int:
        return len(self.pool_tokens)

    def pool_pages(self, pool: int) -> int:
        """Usable pages of `pool` (page 0 not counted)."""
        return self.pool_tokens[pool] // self.page_size

    def describe(self) -> str:
        """One log line's worth: the pools and how many layers read each."""
        names = ("full", "SWA")
        parts = [f"{names[p]} pool {self.pool_tokens[p]} tokens for {self.layer_pool.count(p)} layers"
                 for p in range(self.num_pools)]
        states = "".join(f", {s.name} state of {s.bytes_per_request} B per request" for s in self.req_states)
        rows = "".join(f", {r.name} rows of {r.bytes_per_row} B, {r.rows_per_request} per request"
                       for r in self.req_rows)
        return ", ".join(parts) + f", pages of {self.page_size}" + states + rows


def plan_kv_cache(budget_tokens: int, page_size: int, num_layers: int, swa_layer_ids: Iterable[int], *,
                  sliding_window: Optional[int] = None, hybrid_swa_memory: bool = True,
                  swa_full_tokens_ratio: float = 0.8) -> KVCacheSpec:
    """The KV buffers a budget of `budget_tokens` tokens of every layer buys.

    Sliding-window layers (`swa_layer_ids`, window `sliding_window` tokens) get their own, smaller pool when
    `hybrid_swa_memory` (not --disable-hybrid-swa-memory): the budget is split by `split_hybrid_budget`
    (--swa-full-tokens-ratio). Otherwise every layer reads one pool of `budget_tokens` rounded down to whole
    pages (the windows are only masked).

    Raises:
        ValueError: the budget leaves less than a page in a pool.
    """
    swa = set(swa_layer_ids)
    if swa and hybrid_swa_memory:
        full, swa_tokens = split_hybrid_budget(budget_tokens, num_layers - len(swa), len(swa), swa_full_tokens_ratio,
                                               page_size)
        if sliding_window is None:
            raise ValueError("sliding-window layers without a sliding_window")
        return KVCacheSpec(page_size, (full, swa_tokens),
                           tuple(SWA_POOL if i in swa else FULL_POOL for i in range(num_layers)), sliding_window)
    tokens = budget_tokens // page_size * page_size
    if tokens < page_size:
        raise ValueError(f"a KV budget of {budget_tokens} tokens is less than one page ({page_size})")
    return KVCacheSpec(page_size, (tokens,), (FULL_POOL,) * num_layers)


def kv_spec_for(server_args, model_config, budget_tokens: int) -> KVCacheSpec:
    """`plan_kv_cache` with the model's layers, sliding-window layers and window, and the flags (--page-size,
    --disable-hybrid-swa-memory, --swa-full-tokens-ratio). With --enable-hierarchical-cache every layer reads one
    pool (the host tier copies whole pages of every layer; a hybrid SWA pool's pages have no host copy)."""
    hybrid = not (server_args.disable_hybrid_swa_memory or getattr(server_args, "enable_hierarchical_cache", False))
    spec = plan_kv_cache(budget_tokens, server_args.page_size, model_config.num_hidden_layers,
                         model_config.swa_layer_ids, sliding_window=model_config.sliding_window,
                         hybrid_swa_memory=hybrid,
                         swa_full_tokens_ratio=server_args.swa_full_tokens_ratio)
    states = tuple(ReqStateSpec(name, int(size)) for name, size in getattr(model_config, "req_states", ()))
    rows = tuple(ReqRowsSpec(name, int(size), int(n)) for name, size, n in getattr(model_config, "req_rows", ()))
    return dataclasses.replace(spec, req_states=states, req_rows=rows)


@dataclasses.dataclass(frozen=True)
class _CacheFlags:
    """The cache flags of ServerArgs, for callers without one (benchmarks and tests)."""

    disable_radix_cache: bool = False


@dataclasses.dataclass
class PrefixMatch:
    """A waiting request's reusable prefix, locked in the prefix cache until admitted or released.

    match: the slots and node (`MatchResult`); moved / swa_moved: tokens the lock moved from evictable to
    protected (full pool / SWA pool); session: the streaming session whose KV the turn reuses (None: none).
    """

    match: MatchResult
    moved: int
    swa_moved: int
    session: Optional[SessionKV]

    @property
    def length(self) -> int:
        return self.match.length


class KVMemory:
    """One rank's KV memory (see the module docstring).

    Args:
        req_to_token_pool: the request-slot table.
        allocator: the paged allocator (a `SWAPagedAllocator` with hybrid SWA memory).
        tree_cache: the prefix cache over them (any registered kind).
        sliding_window: the model's window in tokens; used only when `allocator` has a separate SWA pool.
        swa_release: free each running request's SWA KV as it leaves the window (SGL_JAX_DISABLE_SWA_RELEASE turns
            it off, for measuring what it buys).
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: PagedTokenToKVPoolAllocator, tree_cache, *,
                 sliding_window: Optional[int] = None, swa_release: bool = True):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.hybrid = isinstance(allocator, SWAPagedAllocator)
        self.window = sliding_window if self.hybrid else None
        self.swa_release = swa_release
        self.page_size = allocator.page_size
        self.faults = PlantedFaults.from_env()  # test hooks (fault_injection.py); none outside tests

    @classmethod
    def create(cls, spec: KVCacheSpec, *, num_request_slots: int, context_len: int, server_args=None,
               disable_radix_cache: bool = False, swa_release: Optional[bool] = None,
               host_tier: Optional[HostTier] = None) -> "KVMemory":
        """The host side of a rank's KV buffers `spec`: request slots, allocator(s) and the prefix cache kind
        `registry.cache_kind_for` picks from the flags (`server_args`; without it, radix or, with
        `disable_radix_cache`, chunk). `swa_release` None: on unless SGL_JAX_DISABLE_SWA_RELEASE=1. `host_tier`:
        the rank's host pool and mover, which the "hiradix" kind (--enable-hierarchical-cache) needs.

        Raises:
            ValueError: the kind cannot serve the spec, or "hiradix" without `host_tier` (`registry`)."""
        if swa_release is None:
            swa_release = os.environ.get(DISABLE_SWA_RELEASE_ENV) != "1"
        pool = ReqToTokenPool(num_request_slots, context_len,
                              [ReqStatePool(state, num_request_slots) for state in spec.req_states],
                              [ReqRowsPool(r, r.pages(r.rows_per_request) * num_request_slots) for r in spec.req_rows])
        ps = spec.page_size
        if spec.num_pools > 1:
            allocator = SWAPagedAllocator(spec.pool_tokens[FULL_POOL], spec.pool_tokens[SWA_POOL], ps)
        else:
            allocator = PagedTokenToKVPoolAllocator(spec.pool_tokens[FULL_POOL], ps)
        flags = server_args if server_args is not None else _CacheFlags(disable_radix_cache)
        kind = cache_kind_for(flags, spec.num_pools > 1)
        cache = create_prefix_cache(kind, pool, allocator, ps, spec.sliding_window,
                                    host_tier if kind == "hiradix" else None)
        return cls(pool, allocator, cache, sliding_window=spec.sliding_window, swa_release=swa_release)

    # ------------------------------------------------------------ sizes
    @property
    def size(self) -> int:
        """Usable KV tokens (the full pool)."""
        return self.allocator.size

    @property
    def cache_kind(self) -> str:
        return self.tree_cache.kind

    @property
    def keeps_namespaces(self) -> bool:
        """Whether the prefix cache keeps LoRA adapters' prefixes apart and retired prefixes
        (`BasePrefixCache.keeps_namespaces`)."""
        return self.tree_cache.keeps_namespaces

    def free_tokens(self) -> int:
        return self.allocator.available_size()

    def free_req_slots(self) -> int:
        return self.req_to_token_pool.available_size()

    def prefix_match_len(self, token_ids, namespace=None) -> int:
        """Tokens of `token_ids` the prefix cache would serve in `namespace` (a LoRA adapter's uid, None: the base
        model's), the part a host tier would load back included (read-only; cache-aware DP assignment, the lpm
        order)."""
        if getattr(self.tree_cache, "host", None) is not None:
            return self.tree_cache.prefix_match_len(token_ids, namespace, include_unmatchable=True)
        return self.tree_cache.prefix_match_len(token_ids, namespace)

    def row(self, req) -> np.ndarray:
        """`req`'s ReqToTokenPool row (KV slot per position)."""
        return self.req_to_token_pool.req_to_token[req.req_pool_idx]

    # ------------------------------------------------------------ admission and allocation
    def budget(self, running: Sequence[Tuple[object, int]], chunk_size: Optional[int]) -> "KVBudget":
        """What one admission round may still promise, after reserving each running request's estimated future
        tokens (`running`: (req, future tokens) pairs)."""
        return KVBudget(self, running, chunk_size)

    def rows_problem(self, rows_needed: Dict[str, int]) -> Optional[str]:
        """Why a request needing `rows_needed` ({row pool name: rows}) could never be admitted on this rank (a name
        no row pool has, or more pages than the pool holds), for a 400 at intake; None when it can."""
        try:
            pages = self.req_to_token_pool.row_pages_needed(rows_needed)
        except ValueError as e:
            return str(e)
        sizes = {p.name: p.size for p in self.req_to_token_pool.row_pools}
        for name, n in pages.items():
            if n > sizes[name]:
                return f"{rows_needed[name]} {name} rows need {n} pages; the pool holds {sizes[name]}"
        return None

    def allocate_extend(self, req) -> None:
        """Give `req` a request slot (first time: with its matched prefix; a streaming session's turn: the
        session's row) and KV slots for its next ``extend_input_len`` tokens, evicting cached KV if needed.

        Raises:
            RuntimeError: the pools ran out (admission, through `KVBudget`, prevents that).
        """
        pool = self.req_to_token_pool
        if req.req_pool_idx is None and req.session_kv is not None and req.session_kv.has_kv():
            n = req.session_kv.lend(req, self.tree_cache)  # a streaming session's turn: the session's row and KV
            assert n == len(req.prefix_indices), "the session's KV changed between admission and extend"
        elif req.req_pool_idx is None:
            req.req_pool_idx = pool.alloc()
            if req.req_pool_idx is None:
                raise RuntimeError("ReqToTokenPool is full; admission should have prevented this")
            n = len(req.prefix_indices)
            pool.write(req.req_pool_idx, 0, req.prefix_indices)
            req.kv_allocated_len = req.kv_committed_len = req.cache_protected_len = req.swa_evicted_len = n
            req.kv_released = False
        if req.rows_needed and not pool.row_counts[:, req.req_pool_idx].any():  # (a retracted request's return too)
            if not pool.alloc_rows(req.req_pool_idx, req.rows_needed):
                raise RuntimeError("a per-request row pool is full; admission should have prevented this")
        assert req.kv_allocated_len == req.kv_committed_len
        end = req.kv_committed_len + req.extend_input_len
        slots = alloc_with_evict(self.allocator, self.tree_cache, self.row(req), req.kv_allocated_len, end)
        if slots is None:
            raise RuntimeError("KV pool is full; admission should have prevented this")
        pool.write(req.req_pool_idx, req.kv_allocated_len, slots)
        req.kv_allocated_len = end

    def allocate_decode(self, reqs: Sequence, counts: Optional[Sequence[int]] = None) -> bool:
        """One KV slot per request for its last sampled token, evicting cached KV if needed (requests that have
        it already are skipped); with `counts`, the slots of each request's next counts[i] positions from that
        token's on (a multi-step decode). False, with nothing taken, when even eviction cannot free enough pages:
        the caller retracts."""
        if counts is not None:
            return self._allocate_positions(reqs, counts)
        # (ahead: a token still being sampled); the step's hot path: few numpy calls (issue #69)
        todo = [(r, e) for r, e in ((r, r.seqlen_ahead) for r in reqs) if r.kv_allocated_len < e]
        if not todo:
            return True
        if len(todo) <= FEW_ROWS:
            return self._allocate_few(todo)
        n = len(todo)
        pos = np.fromiter((e for _, e in todo), np.int64, n) - 1
        rows = np.fromiter((r.req_pool_idx for r, _ in todo), np.int64, n)
        ps = self.allocator.page_size
        starts = pos % ps == 0 if ps > 1 else None  # (page size 1: every position starts a page)
        if not evict_for_pages(self.allocator, self.tree_cache, n if starts is None else int(starts.sum())):
            return False
        table = self.req_to_token_pool.req_to_token
        if starts is None:
            slots = self.allocator.alloc_pages(n)
        else:
            slots = self.allocator.alloc_decode_slots(table[rows, np.maximum(pos - 1, 0)], pos, starts)
        if slots is None:  # (eviction freed the pages just above)
            raise RuntimeError("KV pages vanished between eviction and allocation")
        table[rows, pos] = slots
        for req, end in todo:
            req.kv_allocated_len = end
        return True

    def _allocate_few(self, todo: list) -> bool:
        """`allocate_decode` of a few requests ([(req, seqlen_ahead)], each missing only its last position's slot)
        with Python scalars: a decode step of a small batch then makes no numpy index iterator (each a multi-KB
        allocation; in the scheduler next to XLA's threads such allocations cost several times their cost alone)."""
        ps = self.allocator.page_size
        starts = [(e - 1) % ps == 0 for _, e in todo]
        need = sum(starts)
        if not evict_for_pages(self.allocator, self.tree_cache, need):
            return False
        pages = self.allocator.alloc_pages(need) if need else np.zeros(0, np.int32)
        if pages is None:  # (eviction freed the pages just above)
            raise RuntimeError("KV pages vanished between eviction and allocation")
        pages = pages.tolist()
        table, k = self.req_to_token_pool.req_to_token, 0
        for (req, end), start in zip(todo, starts):
            row, pos = req.req_pool_idx, end - 1
            if start:
                table[row, pos], k = pages[k] * ps, k + 1
            else:  # (the next slot of the page holding the position before)
                table[row, pos] = table[row, pos - 1] + 1
            req.kv_allocated_len = end
        return True

    def _allocate_positions(self, reqs: Sequence, counts: Sequence[int]) -> bool:
        """`allocate_decode` with counts: request i's positions up to seqlen_ahead - 1 + counts[i], all requests'
        new pages taken at once (each continues its last partly filled page first, as `alloc_token_slots` does)."""
        ps = self.allocator.page_size
        todo = [(r, r.kv_allocated_len, r.seqlen_ahead - 1 + n) for r, n in zip(reqs, counts)]
        todo = [(r, have, want, -(-want // ps) - -(-have // ps)) for r, have, want in todo if have < want]
        if not todo:
            return True
        total = sum(t[3] for t in todo)
        if not evict_for_pages(self.allocator, self.tree_cache, total):
            return False
        pages = self.allocator.alloc_pages(total)
        if pages is None:  # (eviction freed the pages just above)
            raise RuntimeError("KV pages vanished between eviction and allocation")
        table = self.req_to_token_pool.req_to_token
        if len(todo) <= FEW_ROWS:
            write_positions_each(table, todo, pages, ps)
        else:
            write_positions_batched(table, todo, pages, ps)
        for r, _, want, _ in todo:
            r.kv_allocated_len = want
        return True

    def allocate_drafts(self, req, n: int) -> bool:
        """KV slots for `n` more positions of `req` after the ones it has (a verify step's draft slots after its
        root's, which `allocate_decode` gave), from free pages only: slots that live one step never evict cached
        prefixes. False, with nothing taken, when too few pages are free (the step then verifies no draft for it)."""
        end = req.kv_allocated_len + n
        slots = self.allocator.alloc_token_slots(self.row(req), req.kv_allocated_len, end)
        if slots is None:
            return False
        self.req_to_token_pool.write(req.req_pool_idx, req.kv_allocated_len, slots)
        req.kv_allocated_len = end
        return True

    def rollback(self, req, keep: int) -> None:
        """Give back `req`'s positions from `keep` on (a verify step's unaccepted draft slots): the pages wholly
        past it are freed; ``kv_allocated_len`` and ``kv_committed_len`` become at most `keep`.

        Raises:
            ValueError: `keep` below the request's cached prefix (`session_kv.trim_kv`)."""
        trim_kv(req, self.tree_cache, keep)

    def layer_pool_fields(self, page_indices: np.ndarray, out_cache_loc: np.ndarray) -> Dict[str, np.ndarray]:
        """The ForwardBatch fields of the layers that read another pool than the full one: with hybrid SWA memory,
        ``swa_page_indices`` and ``swa_out_cache_loc`` (the full pages and slots translated through the
        full-to-SWA page map; page 0 where a page's SWA KV is gone); {} otherwise."""
        if not self.hybrid:
            return {}
        return {"swa_page_indices": self.allocator.swa_page_table(page_indices),
                "swa_out_cache_loc": self.allocator.swa_slots(out_cache_loc)}

    # ------------------------------------------------------------ after a step, release
    def cache_unfinished(self, req) -> None:
        """Hand a chunk-prefilled request's computed, page-aligned prefix to the prefix cache."""
        cache_unfinished_req(req, self.tree_cache)

    def after_step(self, reqs: Iterable) -> int:
        """Free the SWA KV of running requests that left the window (hybrid SWA memory with SWA release); returns
        the SWA tokens freed."""
        if not (self.window and self.swa_release):
            return 0
        return sum(release_swa_out_of_window(req, self.req_to_token_pool, self.allocator, self.window)
                   for req in reqs if not req.finished())

    def release(self, req, is_insert: bool = True) -> None:
        """Free what `req` holds through the one release path (`common.release_kv_cache`). Under test, a planted
        fault may then leak pages or free a page twice at the first request that finished normally while holding KV
        (`fault_injection.PlantedFaults`)."""
        finished = (is_insert and req.req_pool_idx is not None and not req.kv_released
                    and req.finished_reason is not None and req.finished_reason.type != "abort")
        release_kv_cache(req, self.tree_cache, is_insert=is_insert)
        if not finished:
            return
        if self.faults.fire("leak_pages"):
            self.allocator.alloc_pages(min(self.faults.leak_pages, self.allocator.available_pages()))
        if self.faults.fire("double_free"):
            self.allocator.plant_double_free()
        if self.req_to_token_pool.state_pools and self.faults.fire("leak_state"):
            self.req_to_token_pool.state_pools[0].plant_leak()
        if self.req_to_token_pool.row_pools and self.faults.fire("leak_rows"):
            self.req_to_token_pool.row_pools[0].plant_leak()

    def new_session_kv(self) -> SessionKV:
        """The KV holder of a new streaming session on this rank."""
        return SessionKV(self.window)

    def release_session(self, session_kv: SessionKV) -> None:
        """Free what a closed streaming session holds (through `common.release_kv_cache`)."""
        session_kv.release(self.tree_cache)

    def drop_namespace(self, namespace: int) -> int:
        """Free the prefixes the prefix cache keeps under `namespace` (an unloaded LoRA adapter's uid); returns the
        tokens freed (0 for a cache that keeps no namespaces)."""
        drop = getattr(self.tree_cache, "evict_namespace", None)
        return 0 if drop is None else drop(namespace)

    def retire_cache(self, tag) -> list:
        """The weights changed: nothing cached may be matched again. A radix cache retires its prefixes
        (`RadixCache.retire`: the unlocked freed, the locked moved to retired namespaces, whose keys are
        returned); a cache that keeps nothing has nothing to retire; any other (hybrid SWA) is emptied.

        Raises:
            RuntimeError: a cache without retired namespaces while requests lock prefixes in it.
        """
        retire = getattr(self.tree_cache, "retire", None)
        if retire is not None:
            return retire(tag)
        self.tree_cache.reset()
        return []

    def has_namespace(self, namespace) -> bool:
        """Whether the prefix cache still keeps `namespace` (a retired key until its last prefix is freed)."""
        return namespace in getattr(self.tree_cache, "_namespaces", {})

    def flush(self) -> None:
        """Drop everything the prefix cache holds (only when no request holds a lock)."""
        self.tree_cache.reset()

    # ------------------------------------------------------------ accounting and checks
    def accounting(self, sessions: Sequence[SessionKV] = ()) -> Dict[str, int]:
        """KV tokens by owner, summable over ranks: free, cached (the prefix cache's: evictable + locked), held by
        streaming sessions between turns (whole pages past their cached prefix), in use (running requests,
        scoring handles); with hybrid SWA memory the same for the SWA pool (``swa_*``); with a host tier its pool
        (``host_kv_tokens_total / _free / _cached``) and the tokens it loaded back instead of recomputing and copied
        to the host so far (``host_hit_tokens``, ``host_written_tokens``); each per-request state pool's slots
        (``<name>_state_slots_total / _free / _in_use``) and each row pool's pages (``<name>_pages_*``)."""
        a, c, ps = self.allocator, self.tree_cache, self.page_size
        evictable, protected = c.evictable_size(), c.protected_size()
        held = sum(kv.held_tokens(ps) for kv in sessions)
        acc = {"kv_tokens_total": a.size, "kv_tokens_free": a.available_size(),
               "kv_tokens_cached": evictable + protected, "kv_tokens_session_held": held,
               "kv_tokens_in_use": a.size - a.available_size() - evictable - protected - held,
               "kv_tokens_evictable": evictable, "kv_tokens_protected": protected}
        host = getattr(c, "host", None)
        if host is not None:  # the host tier (HiRadixCache): its pool, and what it saved and copied (cumulative)
            acc.update({"host_kv_tokens_total": c.host_size(), "host_kv_tokens_free": c.host_available_size(),
                        "host_kv_tokens_cached": c.host_used_size(), "host_hit_tokens": c.num_host_hit_tokens,
                        "host_written_tokens": c.num_host_written_tokens})
        for state in self.req_to_token_pool.state_pools:  # (per-request state: slots, not tokens)
            free = state.available_size()
            acc.update({f"{state.name}_state_slots_total": state.size, f"{state.name}_state_slots_free": free,
                        f"{state.name}_state_slots_in_use": state.size - free})
        for rows in self.req_to_token_pool.row_pools:  # (per-request rows: pages of rows, not tokens)
            free = rows.available_size()
            acc.update({f"{rows.name}_pages_total": rows.size, f"{rows.name}_pages_free": free,
                        f"{rows.name}_pages_in_use": rows.size - free})
        if self.hybrid:
            swa_evictable, swa_protected = self._swa_cached()
            swa_held = sum(kv.held_swa_tokens(ps) for kv in sessions)
            acc.update({"swa_tokens_total": a.swa_size, "swa_tokens_free": a.swa_available_size(),
                        "swa_tokens_cached": swa_evictable + swa_protected, "swa_tokens_session_held": swa_held,
                        "swa_tokens_in_use": a.swa_size - a.swa_available_size() - swa_evictable - swa_protected
                        - swa_held,
                        "swa_tokens_evictable": swa_evictable, "swa_tokens_protected": swa_protected})
        return acc

    def _swa_cached(self) -> Tuple[int, int]:
        """(evictable, protected) SWA tokens of the prefix cache (0, 0 for a kind that keeps no SWA KV)."""
        c = self.tree_cache
        return (c.swa_evictable_size(), c.swa_protected_size()) if c.keeps_swa else (0, 0)

    def check_invariants(self, holders: Iterable) -> List[str]:
        """The exact check (kv_invariants.py): every page owned once, by the free list, a cache node or one of
        `holders`; every request slot free or held once; every prefix node locked once per holder whose locked
        prefix runs through it (a node locked twice is caught while its request runs, not only when idle).

        Args:
            holders: everything that holds KV -- a row or a prefix lock: running and chunk-prefilled requests,
                scoring-cache handles' requests, streaming sessions' holders (the rank's ``kv_holders``). Exact
                when no admission round is under way (see kv_invariants.py).
        Returns:
            The violated invariants, one message each ([] when exact).
        """
        return check_kv_invariants(self.allocator, self.tree_cache, self.req_to_token_pool, holders)

    def idle_problems(self, sessions: Sequence[SessionKV]) -> List[str]:
        """What is wrong when nothing runs on the rank: the exact check with the sessions' holders as the only
        holders (a leaked page and a twice-owned page cannot cancel out; a prefix locked by no session is a lock
        no holder accounts for), every request slot free but theirs, and free + cached + session-held == total
        in each pool (KV tokens), the host pool's free + cached == total with a host tier.

        Args:
            sessions: the rank's streaming sessions' KV (`SessionKV`; those holding none are skipped).
        Returns:
            The problems, one message each ([] when clean).
        """
        holders = [s.holder for s in sessions if s.has_kv()]
        problems = self.check_invariants(holders)
        acc = self.accounting(sessions)
        if acc["kv_tokens_in_use"] != 0:
            problems.append(f"{acc['kv_tokens_in_use']} KV tokens in use with nothing running")
        pool = self.req_to_token_pool
        if pool.available_size() + len(holders) != pool.size:
            problems.append(f"request slots: {pool.available_size()} free + {len(holders)} held by sessions != "
                            f"{pool.size}")
        if "host_kv_tokens_total" in acc and acc["host_kv_tokens_free"] + acc["host_kv_tokens_cached"] != \
                acc["host_kv_tokens_total"]:
            problems.append("host KV accounting: " + str({k: v for k, v in acc.items() if k.startswith("host_kv")}))
        # (state slots need no count here: `check_invariants` finds each taken request slot holding one and free
        # ones none, and the request slots were counted just above)
        for rows in pool.row_pools:  # (a session between turns holds none)
            if acc[f"{rows.name}_pages_in_use"] != 0:
                problems.append(f"{rows.name} pages: {acc[f'{rows.name}_pages_in_use']} in use with nothing running")
        if self.hybrid and acc["swa_tokens_in_use"] != 0:
            problems.append("SWA KV accounting: " + str({k: v for k, v in acc.items() if k.startswith("swa_")}))
        return problems


class KVBudget:
    """The pages one admission round may still promise (SGLang's PrefillAdder accounting), in both pools with
    hybrid SWA memory.

    Each running request keeps a reserve for its estimated future tokens; each admitted request takes its
    uncached prompt plus its estimate. With hybrid SWA memory the SWA pool is budgeted for each request's peak
    SWA use, ``window + interval + 2 pages`` (interval: the tokens one step adds, a chunk or the whole prompt;
    never more than the request's final length), minus the SWA pages it already holds. Free plus evictable
    cached pages count as available. Each admitted request also takes the pages of its per-request rows
    (``req.rows_needed``) from what its row pools have free.

    Args:
        memory: the rank's `KVMemory`.
        running: (req, estimated future tokens) of every running request.
        chunk_size: --chunked-prefill-size (None: prompts are prefilled whole).
    """

    def __init__(self, memory: KVMemory, running: Sequence[Tuple[object, int]], chunk_size: Optional[int]):
        self.memory = memory
        self.chunk_size = chunk_size
        a, c = memory.allocator, memory.tree_cache
        self.ps = ps = memory.page_size
        full_free = a.full_available_pages() if memory.hybrid else a.available_pages()
        self.rem_pages = full_free + c.evictable_size() // ps - sum(self._pages(f) for _, f in running)
        self.rem_row_pages = {p.name: p.available_size() for p in memory.req_to_token_pool.row_pools}
        self.rem_swa_pages = 0
        if memory.window:
            swa_evictable, _ = memory._swa_cached()
            self.rem_swa_pages = a.swa_available_pages() + swa_evictable // ps - sum(
                max(0, self._swa_peak_pages(r, 1, f) - own_swa_pages(r, ps)) for r, f in running)

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.ps)

    def _swa_peak_pages(self, req, n: int, future: int) -> int:
        """Peak SWA pages of a request extending n tokens per step (a chunk, or its whole prompt)."""
        if not self.memory.swa_release:
            return self._pages(req.seqlen + future)
        interval = n if n == 1 or self.chunk_size is None else self.chunk_size
        return self._pages(min(req.seqlen + future, self.memory.window + interval + 2 * self.ps))

    def available_pages_now(self) -> int:
        """Pages an allocation could get now: free plus evictable (in both pools with hybrid SWA memory)."""
        m = self.memory
        a, c = m.allocator, m.tree_cache
        if not m.hybrid:
            return a.available_pages() + c.evictable_size() // self.ps
        full = a.full_available_pages() + c.evictable_size() // self.ps
        return min(full, a.swa_available_pages() + m._swa_cached()[0] // self.ps)

    def match(self, req) -> PrefixMatch:
        """Match and lock `req`'s reusable prefix (the prefix cache's, a scoring handle's, or its streaming
        session's); undo with `unlock` when it is not admitted."""
        swa_before = self.memory._swa_cached()[0]
        match, moved = match_req(req, self.memory.tree_cache)
        if match.length and match.last_node is not None and self.memory.faults.fire("double_lock"):
            self.memory.tree_cache.inc_lock_ref(match.last_node)  # a planted fault: the lock is never undone
        session = req.session_kv if req.session_kv is not None and req.session_kv.has_kv() else None
        return PrefixMatch(match, moved, swa_before - self.memory._swa_cached()[0], session)

    def unlock(self, m: PrefixMatch) -> None:
        self.memory.tree_cache.dec_lock_ref(m.match.last_node)

    def reserve(self, req, m: PrefixMatch, n: int, future: int) -> bool:
        """Take the pages of admitting `req` (prefix `m`, `n` tokens this step, `future` estimated tokens after
        its prompt) if they fit; False (nothing taken, the lock kept: the caller unlocks) otherwise."""
        a = self.memory.allocator
        need = a.pages_needed(m.length, req.seqlen) + self._pages(future)
        fits = need <= self.rem_pages - m.moved // self.ps
        swa_need = 0
        if self.memory.window:  # (a session's turn already holds the session's SWA pages)
            held = m.session.held_swa_tokens(self.ps) // self.ps if m.session is not None else 0
            swa_need = max(0, self._swa_peak_pages(req, n, future) - held)
            fits = fits and swa_need <= self.rem_swa_pages - m.swa_moved // self.ps
        if m.session is not None:  # its first extend's pages must be there now (its window is already held)
            fits = fits and a.pages_needed(m.length, m.length + n) <= self.available_pages_now()
        row_need = self._row_pages(req)
        fits = fits and all(p <= self.rem_row_pages[name] for name, p in row_need.items())
        if fits:
            self.rem_pages -= need + m.moved // self.ps
            self.rem_swa_pages -= swa_need + m.swa_moved // self.ps
            for name, p in row_need.items():
                self.rem_row_pages[name] -= p
        return fits

    def _row_pages(self, req) -> Dict[str, int]:
        """The row pages `req` takes at its extend (``req.rows_needed``), per row pool name.

        Raises:
            ValueError: `req` names a row pool this rank does not have."""
        return self.memory.req_to_token_pool.row_pages_needed(req.rows_needed)

    def reserve_chunk(self, req, n: int, future: int) -> bool:
        """Take the pages of the next `n`-token chunk of a request being prefilled in chunks (its whole remaining
        prompt and `future` estimated tokens stay reserved for it either way). False when the chunk's pages
        cannot be had now."""
        a = self.memory.allocator
        pages = a.pages_needed(req.kv_allocated_len, req.kv_committed_len + n)
        self.rem_pages -= a.pages_needed(req.kv_allocated_len, req.seqlen) + self._pages(future)
        if pages > self.available_pages_now():
            return False
        if self.memory.window:
            self.rem_swa_pages -= max(0, self._swa_peak_pages(req, n, future) - own_swa_pages(req, self.ps))
        return True


def write_positions_each(table: np.ndarray, todo: list, pages: np.ndarray, ps: int) -> None:
    """Write the KV slots of new positions into `table` (int32[slots, context], `req_to_token`), one request at a
    time: a few numpy calls each, the cheaper way for a few requests (a small batch's multi-step decode).

    todo: [(req, have, want, new pages)] per request: positions have .. want - 1 get slots, those in its last
    partly filled page first (continuing that page's slots), the rest in its share of `pages` (int32, the requests'
    new pages in todo's order), in order. Same result as `write_positions_batched`."""
    off = 0
    for r, have, want, need in todo:
        row = table[r.req_pool_idx]
        split = min(want, -(-have // ps) * ps)  # (positions before it are in the last partly filled page)
        if split > have:
            row[have:split] = row[have - 1] + np.arange(1, split - have + 1, dtype=row.dtype)
        if need:
            new = pages[off:off + need]
            off += need
            row[split:want] = new if ps == 1 else (new[:, None] * ps + np.arange(ps)).reshape(-1)[:want - split]


def write_positions_batched(table: np.ndarray, todo: list, pages: np.ndarray, ps: int) -> None:
    """`write_positions_each` for every request at once (a fixed number of numpy calls, for many requests)."""
    n_req = len(todo)
    have = np.fromiter((t[1] for t in todo), np.int64, n_req)
    want = np.fromiter((t[2] for t in todo), np.int64, n_req)
    need = np.fromiter((t[3] for t in todo), np.int64, n_req)
    rows = np.fromiter((t[0].req_pool_idx for t in todo), np.int64, n_req)
    have_pages = -(-have // ps)
    n = want - have
    which = np.repeat(np.arange(n_req), n)  # the request of each new position
    pos = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n) + have[which]
    page_idx = pos // ps
    last = table[rows, np.maximum(have_pages - 1, 0) * ps] // ps  # each request's last page (if any)
    first_new = np.cumsum(need) - need  # its first page in `pages`
    in_last = page_idx < have_pages[which]  # (a position in the request's last, partly filled page)
    page = last[which]
    if len(pages):  # (none when every position fits in the pages the requests have)
        page = np.where(in_last, page, pages[np.where(in_last, 0, first_new[which] + page_idx - have_pages[which])])
    table[rows[which], pos] = (page * ps + pos % ps).astype(table.dtype)
