"""Exact page-ownership check of one rank's KV pools (the strict accounting check, run after every step when
``SGL_JAX_CHECK_KV_INVARIANTS=1``; SGLang's ``SGLANG_CHECK_KV_PAGE_INVARIANTS`` plays the same role).

Every usable full page is owned exactly once: by the free list, by one prefix-cache node, or by one holder of
KV (a running or chunk-prefilled request, a scoring-cache handle, a streaming session between turns) through
positions [cache_protected_len, kv_allocated_len) of its ReqToTokenPool row. With hybrid SWA memory every SWA page is
either free or mapped from exactly one full page that is not free. Each holder also keeps
``cache_protected_len`` page-aligned and ``kv_committed_len <= kv_allocated_len``.

Every slot of a per-request state pool (req_state.py) is owned once, by its free list or by one taken request slot
(`req_state_problems`); so is every page of a per-request row pool (`req_row_problems`).

With a host tier (HiRadixCache) every host page is owned once too, by the host pool's free list or one node's host
copy (`host_problems`); nodes on host only hold no device page and no lock.

Prefix locks (`lock_problems`, a tree cache only) are exact too: each node's ``lock_ref`` equals the number of
holders whose locked prefix (``last_node``) runs through it, the root's is 1, and the cache's protected /
evictable sizes are the tokens of its locked / unlocked nodes; with SWARadixCache the same for ``swa_lock_ref``
(a holder locks the nodes from ``align_down(end - window)`` of its prefix in the SWA pool), tombstones hold no SWA
lock, and the SWA sizes count live nodes. The lock holders are the page holders: every lock is taken by
`cache_manager.match_req` at admission and becomes the admitted request's ``last_node`` (or is undone at once),
moves with it through chunked prefill (`cache_unfinished_req`), to a streaming session's holder when a turn ends
(`SessionKV.on_release`) or to a scoring-cache handle's request (scheduler/scoring.py), and is dropped by
`release_kv_cache`. The check is therefore exact whenever no admission round is under way (a waiting request
between `KVBudget.match` and its admission or `unlock` holds a lock no holder names): after a step, when the
scheduler runs it, and between the operations of the mem_cache tests.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, List, Tuple

import numpy as np

from sgl_jax.srt.mem_cache.swa_allocator import SWAPagedAllocator


def cached_pages(tree_cache) -> np.ndarray:
    """Full pages held by a prefix cache's nodes (none for a cache without a tree, e.g. ChunkCache)."""
    nodes = getattr(tree_cache, "nodes", None)
    if nodes is None:
        return np.zeros(0, np.int32)
    ps = tree_cache.page_size
    vals = [np.asarray(n.value)[::ps] // ps for n in nodes() if n.value is not None]  # (None: on host only)
    return np.concatenate(vals).astype(np.int32) if vals else np.zeros(0, np.int32)


def _locked_path(node, root) -> List:
    """The nodes a lock on `node` counts on, from `node` up to (not including) `root`; [] for None or the root."""
    path = []
    while node is not None and node is not root:
        path.append(node)
        node = node.parent
    return path


def _expected_locks(tree_cache, holders: List, in_tree: set) -> Tuple[Counter, Counter, List[str]]:
    """(full locks, SWA locks) each node should carry (by ``id(node)``), counted from the holders' locked prefixes,
    and the holders whose locked node is not in the tree."""
    root, swa = tree_cache.root, tree_cache.keeps_swa
    full, swa_locks, problems = Counter(), Counter(), []
    for h in holders:
        path = _locked_path(getattr(h, "last_node", None), root)
        if path and id(path[0]) not in in_tree:
            problems.append(f"{getattr(h, 'rid', h)}: its locked prefix node is not in the prefix cache")
            continue
        full.update(id(n) for n in path)
        if swa and path:
            start, pos = tree_cache.swa_lock_start(sum(len(n.key) for n in path)), 0
            for n in reversed(path):  # root first: the SWA lock covers the nodes from `start` on
                if pos >= start:
                    swa_locks[id(n)] += 1
                pos += len(n.key)
    return full, swa_locks, problems


def lock_problems(tree_cache, holders: Iterable) -> List[str]:
    """The prefix-lock invariants a tree cache violates ([] when exact, and always for a cache without a tree).

    Args:
        tree_cache: the rank's prefix cache (RadixCache, LFURadixCache, SWARadixCache; others have no ``root``).
        holders: every holder of KV (see `check_kv_invariants`); each locks the path to its ``last_node``
            (None: nothing).
    Returns:
        One message per violated invariant: nodes whose ``lock_ref`` (``swa_lock_ref``) differs from the number
        of holders whose locked path (SWA window) covers them, a holder locking a node outside the tree, a root
        not locked exactly once, an SWA lock on a tombstone, protected / evictable sizes (tokens) that are not
        the tokens of the locked / unlocked (live) nodes.
    """
    root = getattr(tree_cache, "root", None)
    if root is None:
        return []
    nodes = tree_cache.nodes()
    want, want_swa, problems = _expected_locks(tree_cache, list(holders), {id(n) for n in nodes})
    for ns_root in getattr(tree_cache, "namespace_roots", list)():  # (each locked once of its own)
        want[id(ns_root)] += 1
    swa = tree_cache.keeps_swa
    bad = [f"node {n.id} ({len(n.key)} tokens): lock_ref {n.lock_ref} != {want[id(n)]} holders"
           for n in nodes if n.lock_ref != want[id(n)]]
    if swa:
        bad += [f"node {n.id} ({len(n.key)} tokens): swa_lock_ref {n.swa_lock_ref} != {want_swa[id(n)]} holders"
                for n in nodes if n.swa_lock_ref != want_swa[id(n)]]
    if bad:
        problems.append(f"prefix locks no holder accounts for ({len(bad)} nodes): " + "; ".join(bad[:4]))
    if root.lock_ref != 1 or (swa and root.swa_lock_ref != 1):
        problems.append("the prefix cache's root is not locked exactly once")
    on_device = [n for n in nodes if n.value is not None]  # (a host tier's nodes on host hold no device KV)
    if len(on_device) < len(nodes) and any(n.lock_ref for n in nodes if n.value is None):
        problems.append("a prefix node on host only is locked")
    locked = sum(len(n.key) for n in on_device if n.lock_ref > 0)
    cached = sum(len(n.key) for n in on_device)
    if (tree_cache.protected_size(), tree_cache.evictable_size()) != (locked, cached - locked):
        problems.append(f"prefix cache sizes: protected {tree_cache.protected_size()}, evictable "
                        f"{tree_cache.evictable_size()} != {locked} tokens locked of {cached}")
    if swa:
        problems += _swa_size_problems(tree_cache, nodes)
    return problems


def _swa_size_problems(tree_cache, nodes: List) -> List[str]:
    """SWA locks on tombstones, and SWA protected / evictable sizes that are not the live nodes' tokens."""
    problems = []
    if any(n.tombstone and n.swa_lock_ref for n in nodes):
        problems.append("an SWA lock on a tombstone")
    live = [n for n in nodes if not n.tombstone]
    locked = sum(len(n.key) for n in live if n.swa_lock_ref > 0)
    unlocked = sum(len(n.key) for n in live) - locked
    if (tree_cache.swa_protected_size(), tree_cache.swa_evictable_size()) != (locked, unlocked):
        problems.append(f"prefix cache SWA sizes: protected {tree_cache.swa_protected_size()}, evictable "
                        f"{tree_cache.swa_evictable_size()} != {locked} live tokens locked, {unlocked} unlocked")
    return problems


def host_problems(tree_cache) -> List[str]:
    """The host tier's invariants ([] for a cache without one): every host page owned exactly once, by the host
    pool's free list or one node's host copy; the used count is the nodes' host tokens; a node on host only has
    a host copy, a parent on the device or on host, and nothing below it on the device.

    Args:
        tree_cache: a `HiRadixCache` (others have no ``host``).
    Returns:
        One message per violated invariant.
    """
    host = getattr(tree_cache, "host", None)
    if host is None:
        return []
    problems, ps = [], host.page_size
    nodes = tree_cache.nodes()
    copies = [np.asarray(n.host_value) for n in nodes if n.host_value is not None]
    owned = [host.free_list.ids().astype(np.int64)] + [c[::ps].astype(np.int64) // ps for c in copies]
    counts = np.bincount(np.concatenate(owned), minlength=host.num_pages) if host.num_pages else np.zeros(0)
    if len(counts) > host.num_pages or (counts > 1).any():
        problems.append(f"host KV pages owned twice: {np.nonzero(counts > 1)[0][:8].tolist()}")
    if (counts[:host.num_pages] == 0).any():
        problems.append(f"host KV pages owned by nobody (leaked): {np.nonzero(counts == 0)[0][:8].tolist()}")
    used = sum(len(c) for c in copies)
    if used != tree_cache.host_used_size() or used + host.available_size() != host.size:
        problems.append(f"host KV accounting: {used} tokens in nodes, {tree_cache.host_used_size()} counted used, "
                        f"{host.available_size()} free of {host.size}")
    for n in nodes:
        if n.value is None and (n.host_value is None or any(c.value is not None for c in n.children.values())):
            problems.append(f"node {n.id} is on host without a host copy or with device KV below it")
            break
    return problems


def req_state_problems(pool) -> List[str]:
    """The per-request state pools' ownership (`req_state`): every state slot owned once, by its pool's free list
    or by one taken request slot of `pool` (a ReqToTokenPool), and no free request slot holding one.

    Returns:
        One message per violated invariant, naming the pool and the slots.
    """
    problems: List[str] = []
    free_rows = np.zeros(pool.size, bool)
    free_rows[pool.free_slot_ids()] = True
    for k, state in enumerate(pool.state_pools):
        mine = pool.state_slots[k]
        if (mine[free_rows] != -1).any():
            rows = np.nonzero(free_rows & (mine != -1))[0][:8].tolist()
            problems.append(f"{state.name} state: free request slots {rows} hold state slots")
        held = mine[~free_rows]
        if (held < 0).any() or (held >= state.size).any():
            problems.append(f"{state.name} state: a taken request slot holds no valid state slot")
            held = held[(held >= 0) & (held < state.size)]
        counts = np.bincount(np.concatenate([state.free_slot_ids(), held]).astype(np.int64), minlength=state.size)
        if (counts > 1).any():
            problems.append(f"{state.name} state slots owned twice: {np.nonzero(counts > 1)[0][:8].tolist()}")
        if (counts == 0).any():
            problems.append(f"{state.name} state slots owned by nobody (leaked): "
                            f"{np.nonzero(counts == 0)[0][:8].tolist()}")
    return problems


def req_row_problems(pool) -> List[str]:
    """The per-request row pools' ownership (`req_state.ReqRowsPool`): every page owned once, by its pool's free
    list or by one taken request slot of `pool` (a ReqToTokenPool), each slot holding the pages of its rows, and no
    free request slot holding any.

    Returns:
        One message per violated invariant, naming the pool and the pages or slots.
    """
    problems: List[str] = []
    free_rows = np.zeros(pool.size, bool)
    free_rows[pool.free_slot_ids()] = True
    for k, rows in enumerate(pool.row_pools):
        counts = pool.row_counts[k]
        if (counts[free_rows] != 0).any():
            slots = np.nonzero(free_rows & (counts != 0))[0][:8].tolist()
            problems.append(f"{rows.name} rows: free request slots {slots} hold pages")
        held = [pool.row_pages[k][r] for r in np.nonzero(counts)[0]]
        wrong = [int(r) for r in np.nonzero(counts)[0] if len(pool.row_pages[k][r]) != rows.spec.pages(counts[r])]
        if wrong:
            problems.append(f"{rows.name} rows: request slots {wrong[:8]} hold a page count unlike their rows'")
        pages = np.concatenate([rows.free_page_ids()] + held).astype(np.int64)
        if len(pages) and (pages.min() < 0 or pages.max() >= rows.size):
            problems.append(f"{rows.name} rows: a page id outside the pool")
            pages = pages[(pages >= 0) & (pages < rows.size)]
        owners = np.bincount(pages, minlength=rows.size)
        if (owners > 1).any():
            problems.append(f"{rows.name} pages owned twice: {np.nonzero(owners > 1)[0][:8].tolist()}")
        if (owners == 0).any():
            problems.append(f"{rows.name} pages owned by nobody (leaked): {np.nonzero(owners == 0)[0][:8].tolist()}")
    return problems


def check_kv_invariants(allocator, tree_cache, pool, holders: Iterable) -> List[str]:
    """The violated invariants (an empty list when the accounting is exact): page ownership, request slots and
    prefix locks (`lock_problems`).

    Args:
        allocator: the rank's allocator; tree_cache: its prefix cache; pool: its ReqToTokenPool.
        holders: every object holding KV -- a row or a prefix lock (running and chunk-prefilled requests,
            scoring-cache handles' requests, streaming sessions' holders: ``req_pool_idx``,
            ``cache_protected_len``, ``kv_committed_len``, ``kv_allocated_len``, ``last_node``).
    Returns:
        One message per violated invariant (str), naming the pages, slots or nodes.
    """
    holders = list(holders)
    ps = allocator.page_size
    problems: List[str] = lock_problems(tree_cache, holders) + host_problems(tree_cache)
    owned = [allocator.free_page_ids(), cached_pages(tree_cache)]
    rows = set()
    for h in holders:
        if h.req_pool_idx is None:
            continue
        if h.req_pool_idx in rows:
            problems.append(f"request slot {h.req_pool_idx} held twice")
        rows.add(h.req_pool_idx)
        if h.cache_protected_len % ps:
            problems.append(f"{getattr(h, 'rid', h)}: cache_protected_len {h.cache_protected_len} is not a "
                            f"multiple of page_size {ps}")
        if not h.cache_protected_len <= h.kv_committed_len <= h.kv_allocated_len:
            problems.append(f"{getattr(h, 'rid', h)}: cache_protected_len {h.cache_protected_len}, "
                            f"kv_committed_len {h.kv_committed_len}, kv_allocated_len {h.kv_allocated_len} "
                            "out of order")
        start = -(-h.cache_protected_len // ps) * ps
        owned.append(pool.req_to_token[h.req_pool_idx, start:h.kv_allocated_len:ps] // ps)
    free_slots = set(pool.free_slot_ids())
    if rows & free_slots:
        problems.append(f"request slots {sorted(rows & free_slots)} are held and free")
    problems += req_state_problems(pool) + req_row_problems(pool)
    if len(free_slots) + len(rows) != pool.size:
        problems.append(f"request slots: {len(free_slots)} free + {len(rows)} held != {pool.size}")
    pages = np.concatenate(owned).astype(np.int64)
    counts = np.bincount(pages, minlength=allocator.num_pages + 1)[1:allocator.num_pages + 1]
    if len(pages) and (pages.min() < 1 or pages.max() > allocator.num_pages):
        problems.append("a page id outside [1, num_pages] is owned")
    if (counts > 1).any():
        problems.append(f"pages owned twice: {(np.nonzero(counts > 1)[0] + 1)[:8].tolist()}")
    if (counts == 0).any():
        problems.append(f"pages owned by nobody (leaked): {(np.nonzero(counts == 0)[0] + 1)[:8].tolist()}")
    if isinstance(allocator, SWAPagedAllocator):
        mapped = allocator.full_to_swa[1:]
        live = mapped[mapped > 0]
        swa_free = allocator.swa.free_page_ids()
        if len(np.unique(live)) != len(live):
            problems.append("an SWA page is mapped from two full pages")
        if np.intersect1d(live, swa_free).size:
            problems.append("an SWA page is mapped and free")
        if len(live) + len(swa_free) != allocator.swa.num_pages:
            problems.append(f"SWA pages: {len(live)} mapped + {len(swa_free)} free != {allocator.swa.num_pages}")
        full_free = allocator.free_page_ids()
        if (allocator.full_to_swa[full_free] > 0).any():
            problems.append("a free full page still maps an SWA page")
    return problems
