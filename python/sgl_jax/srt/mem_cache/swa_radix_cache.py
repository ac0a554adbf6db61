"""SWARadixCache: the radix cache for sliding-window models with hybrid SWA memory (`SWAPagedAllocator`).

Every node owns full KV pages; a node's pages either all still have their SWA pages (a live node) or none
of them do (a *tombstone*: its SWA KV was evicted, its full KV stays). The tree is a RadixCache otherwise
(page-aligned nodes, LRU eviction of unlocked leaves), with these differences (SGLang's `SWARadixCache`):

- **Matching.** A request that reuses a prefix of length L computes position L onwards, and its sliding-window
  layers read positions L - W .. L - 1 from the cache. A match is therefore usable only where the last W
  tokens before its end hold live SWA KV (or the whole path from the root is live): `match_prefix` returns
  the longest such prefix, which may stop before a tombstone-shortened window.
- **Healing.** Inserting a prefix over a tombstone whose caller-owned duplicate pages still have SWA KV moves
  those SWA pages onto the node's full pages (same tokens at the same positions, so the same K/V); the node
  is live again and the caller frees only its duplicate full pages.
- **Two evictions.** `evict` (full pool) frees unlocked leaves from both pools, least recently used first.
  `evict_swa` (SWA pool) walks live nodes without an SWA lock in LRU order: an unlocked leaf is deleted
  (both pools), any other node becomes a tombstone (SWA pages freed, full pages kept). A tombstone left as
  an unlocked leaf is deleted too (no match can use it).
- **Two locks.** A lock on a prefix ending at position E protects its whole path in the full pool
  (``full_lock_ref``) but only the window a request needs, positions >= align_down(E - W), in the SWA pool
  (``swa_lock_ref``). The window start is a function of the locked node's end alone, so `dec_lock_ref`
  finds exactly the nodes `inc_lock_ref` locked, however the tree was split in between.

Accounting: full: free + evictable + protected (+ requests' own pages) == total, as RadixCache; SWA:
swa free + swa_evictable + swa_protected (+ requests' own live SWA pages) == swa total, where the SWA sizes
count live nodes only.

Source: SGLang `python/sglang/srt/mem_cache/swa_radix_cache.py` (design followed, code our own).
"""

from __future__ import annotations

import heapq
import time
from typing import List, Optional, Tuple

import numpy as np

from sgl_jax.srt.mem_cache.base_prefix_cache import MatchResult, TokenIds
from sgl_jax.srt.mem_cache.radix_cache import RadixCache, TreeNode, _common_len
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sgl_jax.srt.mem_cache.swa_allocator import SWAPagedAllocator


class SWATreeNode(TreeNode):
    """A TreeNode with SWA state: ``tombstone`` (its SWA pages were freed) and ``swa_lock_ref`` (locks whose
    window covers it; ``lock_ref`` is the full-pool lock count)."""

    __slots__ = ("tombstone", "swa_lock_ref")

    def __init__(self, key: np.ndarray, value: np.ndarray, parent: Optional["SWATreeNode"], tombstone: bool = False):
        super().__init__(key, value, parent)
        self.tombstone = tombstone
        self.swa_lock_ref = 0


class SWARadixCache(RadixCache):
    """Radix cache over a full + SWA paged pool (see the module docstring).

    Args:
        req_to_token_pool: the request-slot table.
        allocator: the hybrid allocator (full pages, each mapped to an SWA page while its SWA KV is live).
        page_size: tokens per page.
        sliding_window: W, the model's sliding window in tokens (the SWA layers see positions q - W + 1 .. q).
    Raises:
        ValueError: sliding_window < 1.
    """

    kind = "swa_radix"
    keeps_namespaces = False  # (`_root_of`)

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: SWAPagedAllocator, page_size: int,
                 sliding_window: int):
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.window = sliding_window
        super().__init__(req_to_token_pool, allocator, page_size)

    node_cls = SWATreeNode
    keeps_swa = True

    @classmethod
    def create(cls, req_to_token_pool: ReqToTokenPool, allocator, page_size: int,
               sliding_window: Optional[int] = None) -> "SWARadixCache":
        """Raises ValueError without a hybrid allocator (`SWAPagedAllocator`) and the model's sliding window."""
        if not isinstance(allocator, SWAPagedAllocator) or not sliding_window:
            raise ValueError("the swa_radix prefix cache needs a hybrid SWA KV pool and the model's sliding window")
        return cls(req_to_token_pool, allocator, page_size, sliding_window)

    def reset_tree(self) -> None:
        super().reset_tree()
        self.root.swa_lock_ref = 1  # never evicted
        self._swa_evictable = self._swa_protected = 0

    def _split(self, child: SWATreeNode, n: int) -> SWATreeNode:
        """Split `child` after n tokens; the upper part shares its locks and tombstone state (both parts lie
        inside every lock and window that covered `child`: see `swa_lock_start`)."""
        upper = super()._split(child, n)
        upper.tombstone, upper.swa_lock_ref = child.tombstone, child.swa_lock_ref
        return upper

    # ------------------------------------------------------------ matching
    def _walk(self, key: np.ndarray) -> List[Tuple[SWATreeNode, int]]:
        """(node, matched tokens in it) along the path `key` follows (page-aligned; read-only)."""
        path, node = [], self.root
        while len(key):
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = self._align(_common_len(child.key, key))
            if n == 0:
                break
            path.append((child, n))
            if n < len(child.key):
                break
            node, key = child, key[n:]
        return path

    def _best_usable(self, path: List[Tuple[SWATreeNode, int]]) -> int:
        """Index into `path` of the deepest node whose (matched) end has live SWA KV over the W tokens
        before it, or over everything from the root; -1: only the empty prefix is usable."""
        best, pos, live_since = -1, 0, 0
        for i, (node, n) in enumerate(path):
            pos += n
            if node.tombstone:
                live_since = pos
            elif live_since == 0 or pos - live_since >= self.window:
                best = i
        return best

    def _root_of(self, namespace, create: bool):
        """Only the base namespace: LoRA adapters' prefixes are not kept apart in a hybrid SWA cache.

        Raises:
            ValueError: a namespace other than None.
        """
        if namespace is not None:
            raise ValueError("the swa_radix prefix cache keeps no namespaces (LoRA with hybrid SWA memory: pass "
                             "--disable-hybrid-swa-memory)")
        return self.root

    def match_prefix(self, token_ids: TokenIds, namespace=None) -> MatchResult:
        """The longest cached, page-aligned prefix of `token_ids` that a request can continue from: its last W
        tokens (or all of it, when shorter) hold live SWA KV. Splits the node the match ends inside and
        touches the matched nodes (LRU). `namespace`: None only (`_root_of`)."""
        self._root_of(namespace, False)
        key = np.asarray(token_ids, np.int32)[:self._align(len(token_ids))]
        path = self._walk(key)
        best = self._best_usable(path)
        if best < 0:
            return MatchResult(device_indices=np.zeros(0, np.int32), last_node=self.root)
        node, n = path[best]
        if n < len(node.key):
            path[best] = (self._split(node, n), n)
        now = time.monotonic()
        for node, _ in path[:best + 1]:
            node.last_access_time = now
        return MatchResult(device_indices=np.concatenate([nd.value for nd, _ in path[:best + 1]]),
                           last_node=path[best][0])

    def prefix_match_len(self, token_ids: TokenIds, namespace=None) -> int:
        """What `match_prefix` would match, without splitting a node or touching access times."""
        self._root_of(namespace, False)
        key = np.asarray(token_ids, np.int32)[:self._align(len(token_ids))]
        path = self._walk(key)
        return sum(n for _, n in path[:self._best_usable(path) + 1])

    # ------------------------------------------------------------ insertion
    def _runs(self, pages: np.ndarray) -> List[Tuple[int, int, bool]]:
        """(first page, end page, has SWA) runs of `pages` (full page ids) by whether they have SWA KV."""
        live = self.allocator.has_swa(pages)
        cuts = [0] + (np.flatnonzero(live[1:] != live[:-1]) + 1).tolist() + [len(pages)]
        return [(a, b, bool(live[a])) for a, b in zip(cuts[:-1], cuts[1:])]

    def _add_suffix(self, parent: SWATreeNode, key: np.ndarray, value: np.ndarray) -> None:
        """New nodes under `parent` for key/value, one per run of pages with / without SWA KV (live nodes /
        tombstones)."""
        ps = self.page_size
        for a, b, live in self._runs(value[::ps] // ps):
            node = SWATreeNode(key[a * ps:b * ps].copy(), value[a * ps:b * ps].copy(), parent, tombstone=not live)
            parent.children[self._child_key(node.key)] = node
            self._evictable += len(node.key)
            if live:
                self._swa_evictable += len(node.key)
            parent = node

    def _insert_over(self, node: SWATreeNode, dup_slots: np.ndarray) -> None:
        """Heal: give tombstone `node` the SWA pages of the caller's duplicate slots of the same tokens, where those
        have them; the node is split so that each part is wholly live or wholly a tombstone."""
        if not node.tombstone:
            return
        ps = self.page_size
        dup_pages = (dup_slots[::ps] // ps).astype(np.int32)
        runs = self._runs(dup_pages)
        parts = []
        for a, b, live in runs[:-1]:  # each cut makes the upper run a new node; `node` stays the lower rest
            parts.append((self._split(node, (b - a) * ps), a, b, live))
        parts.append((node,) + runs[-1])
        for part, a, b, live in parts:
            if live:
                self.allocator.move_swa(dup_pages[a:b], (part.value[::ps] // ps).astype(np.int32))
                part.tombstone = False
                self._swa_evictable += len(part.key)

    # ------------------------------------------------------------ locking
    def _path(self, node: SWATreeNode) -> List[SWATreeNode]:
        """Nodes from the root's child down to `node`."""
        path = []
        while node is not None and node is not self.root:
            path.append(node)
            node = node.parent
        return path[::-1]

    def swa_lock_start(self, end: int) -> int:
        """First position (tokens, page-aligned) a lock on a prefix ending at `end` protects in the SWA pool; the exact
        check (kv_invariants.lock_problems) counts SWA locks by it too."""
        return self._align(max(0, end - self.window))

    def inc_lock_ref(self, node: Optional[SWATreeNode]) -> int:
        """Lock the path to `node` in the full pool and its last W tokens (from `swa_lock_start`, split there)
        in the SWA pool; returns full-pool tokens moved from evictable to protected (None: no-op).

        Raises:
            AssertionError: the window to lock holds a tombstone (`match_prefix` never returns such a node).
        """
        path = self._path(node)
        if not path:
            return 0
        end = sum(len(n.key) for n in path)
        swa_start, pos = self.swa_lock_start(end), 0
        for i, n in enumerate(path):  # make swa_start a node boundary
            if pos < swa_start < pos + len(n.key):
                path.insert(i, self._split(n, swa_start - pos))
                break
            pos += len(n.key)
        moved, pos = 0, 0
        for n in path:
            if n.lock_ref == 0:
                moved += len(n.key)
            n.lock_ref += 1
            if pos >= swa_start:
                assert not n.tombstone, "locking an SWA window that holds a tombstone"
                if n.swa_lock_ref == 0:
                    self._swa_evictable -= len(n.key)
                    self._swa_protected += len(n.key)
                n.swa_lock_ref += 1
            pos += len(n.key)
        self._evictable -= moved
        self._protected += moved
        return moved

    def dec_lock_ref(self, node: Optional[SWATreeNode]) -> int:
        """Undo one `inc_lock_ref(node)`; returns full-pool tokens that became evictable again."""
        path = self._path(node)
        if not path:
            return 0
        swa_start = self.swa_lock_start(sum(len(n.key) for n in path))
        moved, pos = 0, 0
        for n in path:
            assert n.lock_ref > 0, "unbalanced dec_lock_ref"
            n.lock_ref -= 1
            if n.lock_ref == 0:
                moved += len(n.key)
            if pos >= swa_start:
                assert n.swa_lock_ref > 0 and not n.tombstone, "unbalanced SWA dec_lock_ref"
                n.swa_lock_ref -= 1
                if n.swa_lock_ref == 0:
                    self._swa_protected -= len(n.key)
                    self._swa_evictable += len(n.key)
            pos += len(n.key)
        self._evictable += moved
        self._protected -= moved
        return moved

    # ------------------------------------------------------------ eviction
    def _delete_leaf(self, leaf: SWATreeNode) -> Tuple[int, SWATreeNode]:
        """Free an unlocked leaf's pages in both pools and drop it, then every tombstone that became an
        unlocked leaf above it (no match can use one). Returns (full tokens freed, the surviving parent)."""
        freed = 0
        while True:
            self.allocator.free_pages(self._pages(leaf.value))
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key)]
            self._evictable -= len(leaf.key)
            if not leaf.tombstone:
                self._swa_evictable -= len(leaf.key)
            freed += len(leaf.key)
            if parent is self.root or parent.children or parent.lock_ref or not parent.tombstone:
                return freed, parent
            leaf = parent

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves (both pools), least recently used first, until `num_tokens` full-pool tokens
        are freed or none is left. Returns the full tokens freed."""
        heap = [n for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            n, parent = self._delete_leaf(heapq.heappop(heap))
            freed += n
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def evict_swa(self, num_tokens: int) -> int:
        """Free SWA KV, least recently used first, until `num_tokens` SWA tokens are freed or nothing
        evictable is left: an unlocked leaf is deleted (both pools), a live node without an SWA lock otherwise
        becomes a tombstone. Returns the SWA tokens freed."""
        heap = [n for n in self.nodes() if not n.tombstone and n.swa_lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)
            if node.tombstone or node.swa_lock_ref or not self._in_tree(node):
                continue
            if not node.children and node.lock_ref == 0:
                freed += len(node.key)
                self._delete_leaf(node)
            else:
                self.allocator.free_swa(self._pages(node.value))
                node.tombstone = True
                self._swa_evictable -= len(node.key)
                freed += len(node.key)
        return freed

    def _in_tree(self, node: SWATreeNode) -> bool:
        parent = node.parent
        return parent is not None and parent.children.get(self._child_key(node.key)) is node

    # ------------------------------------------------------------ sizes
    def swa_evictable_size(self) -> int:
        """SWA-pool tokens in live nodes without an SWA lock."""
        return self._swa_evictable

    def swa_protected_size(self) -> int:
        """SWA-pool tokens in live nodes inside a locked window."""
        return self._swa_protected

    def retire(self, tag) -> list:
        """No namespaces here (`_root_of`): everything cached is freed, which needs no request to lock any.

        Raises:
            RuntimeError: requests hold locks.
        """
        self.reset()
        return []

    def reset(self) -> None:
        """Free every cached page in both pools and empty the tree. Only valid when no request holds a lock."""
        if self._protected:
            raise RuntimeError("cannot reset the radix cache while requests hold locks")
        self.evict(self._evictable)
        assert self._evictable == 0 and self._swa_evictable == 0
        self.reset_tree()
