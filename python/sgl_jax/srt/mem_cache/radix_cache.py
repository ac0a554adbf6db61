"""RadixCache: a radix tree over token ids whose nodes own KV cache slots (SGLang's RadixAttention).

Each edge holds a run of token ids (``key``) and the KV slots of those tokens (``value``). Requests that
share a prefix find it with `match_prefix` and reuse its KV instead of recomputing it. Node lengths are
multiples of ``page_size``, so every page is owned by exactly one node (or one request, or the free
list). Nodes on a running request's path are locked (``lock_ref > 0``) and never evicted; unlocked leaves
are evicted least-recently-used first when the allocator runs short.

Implements the `BasePrefixCache` contract; requests hand their KV over through `cache_manager`.

Source: Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs" (2024), §3.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Dict, List, Optional

import numpy as np

from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    CacheNode,
    MatchResult,
    TokenIds,
    is_retired,
    retired_namespace,
)
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sgl_jax.srt.mem_cache.swa_allocator import SWAPagedAllocator

_ids = itertools.count()


class TreeNode(CacheNode):
    """One edge of the tree: ``key`` token ids and their KV ``value`` slots (int32, same length)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time", "id")

    def __init__(self, key: np.ndarray, value: np.ndarray, parent: Optional["TreeNode"]):
        self.children: Dict[object, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access_time = time.monotonic()
        self.id = next(_ids)

    def __lt__(self, other: "TreeNode") -> bool:  # heap order: least recently used first
        return (self.last_access_time, self.id) < (other.last_access_time, other.id)


def _common_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class RadixCache(BasePrefixCache):
    """Prefix cache over a paged KV pool.

    Subclasses (SWARadixCache) change the node class (``node_cls``), what a new suffix becomes
    (`_add_suffix`) and what happens to a cached node an insert runs through (`_insert_over`).

    Args:
        req_to_token_pool: the request-slot table (rows of KV slots).
        allocator: the KV page allocator (evicted pages go back to it).
        page_size: tokens per page; matches and inserts are truncated to whole pages.
    """

    kind = "radix"

    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: PagedTokenToKVPoolAllocator, page_size: int):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.reset_tree()

    @classmethod
    def create(cls, req_to_token_pool: ReqToTokenPool, allocator, page_size: int,
               sliding_window: Optional[int] = None) -> "RadixCache":
        """A radix cache over a single (full) pool.

        Raises:
            ValueError: a hybrid SWA allocator (its cache kind is "swa_radix").
        """
        if isinstance(allocator, SWAPagedAllocator):
            raise ValueError("a hybrid SWA KV pool needs the \"swa_radix\" prefix cache kind")
        return cls(req_to_token_pool, allocator, page_size)

    # ------------------------------------------------------------ tree basics
    node_cls = TreeNode

    def reset_tree(self) -> None:
        self.root = self.node_cls(np.zeros(0, np.int32), np.zeros(0, np.int32), None)
        self.root.lock_ref = 1  # never evicted
        self._namespaces: Dict[int, TreeNode] = {}  # namespace -> its root (an empty node under the root)
        self._evictable = 0
        self._protected = 0

    def _root_of(self, namespace: Optional[int], create: bool) -> Optional[TreeNode]:
        """Where prefixes of `namespace` start: the root (None), else the namespace's own empty node under it
        (created when `create`; None when it does not exist). A namespace node is locked once for good, so it is
        evicted only by `evict` once it has no children left."""
        if namespace is None:
            return self.root
        node = self._namespaces.get(namespace)
        if node is None and create:
            node = self.node_cls(np.zeros(0, np.int32), np.zeros(0, np.int32), self.root)
            node.lock_ref = 1
            self.root.children[("namespace", namespace)] = node
            self._namespaces[namespace] = node
        return node

    def namespace_roots(self) -> List[TreeNode]:
        """The namespaces' root nodes (empty, locked once of their own: `_root_of`)."""
        return list(self._namespaces.values())

    def _drop_empty_namespace(self, node: TreeNode) -> None:
        """Remove `node` if it is a namespace's root with nothing under it and no lock but its own."""
        if node.parent is self.root and not len(node.key) and not node.children and node.lock_ref == 1:
            ns = next((k for k, v in self._namespaces.items() if v is node), None)
            if ns is not None:
                del self._namespaces[ns]
                del self.root.children[("namespace", ns)]

    def _child_key(self, key: np.ndarray):
        return int(key[0]) if self.page_size == 1 else tuple(key[:self.page_size].tolist())

    def _align(self, n: int) -> int:
        return n // self.page_size * self.page_size

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split `child` after its first n tokens; returns the new upper node."""
        upper = self.node_cls(child.key[:n], child.value[:n], child.parent)
        upper.lock_ref = child.lock_ref
        upper.last_access_time = child.last_access_time
        upper.children = {self._child_key(child.key[n:]): child}
        child.parent.children[self._child_key(child.key)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        return upper

    def match_prefix(self, token_ids: TokenIds, namespace: Optional[int] = None) -> MatchResult:
        """The longest cached, page-aligned prefix of `token_ids` in `namespace` and the node it ends at.

        Splits a node when the match ends inside it, so the returned node covers exactly the match.
        Touches the matched nodes (LRU).
        """
        key = np.asarray(token_ids, np.int32)[:self._align(len(token_ids))]
        node, values = self._root_of(namespace, create=False), []
        if node is None:
            return MatchResult(device_indices=np.zeros(0, np.int32), last_node=None)
        now = time.monotonic()
        while len(key):
            child = node.children.get(self._child_key(key))
            if child is None or not self._matchable(child):
                break
            child.last_access_time = now
            n = self._align(_common_len(child.key, key))
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            self._matched(child)
            values.append(child.value)
            node, key = child, key[n:]
        value = np.concatenate(values) if values else np.zeros(0, np.int32)
        return MatchResult(device_indices=value, last_node=node)

    def _matchable(self, node: TreeNode) -> bool:
        """Whether `match_prefix` may run through `node` (a subclass's node may hold no device KV)."""
        return True

    def _matched(self, node: TreeNode) -> None:
        """`match_prefix` ran through `node` (a hook for subclasses)."""

    def prefix_match_len(self, token_ids: TokenIds, namespace: Optional[int] = None,
                         include_unmatchable: bool = False) -> int:
        """What `match_prefix` would match, without splitting a node or touching access times (with
        `include_unmatchable`, through the nodes `match_prefix` stops at too: a subclass's KV not on the device)."""
        key = np.asarray(token_ids, np.int32)[:self._align(len(token_ids))]
        node, matched = self._root_of(namespace, create=False), 0
        if node is None:
            return 0
        while len(key):
            child = node.children.get(self._child_key(key))
            if child is None or not include_unmatchable and not self._matchable(child):
                break
            n = self._align(_common_len(child.key, key))
            matched += n
            if n < len(child.key):
                break
            node, key = child, key[n:]
        return matched

    def insert(self, token_ids: TokenIds, kv_slots: np.ndarray, namespace: Optional[int] = None) -> int:
        """Add `token_ids` (page-aligned length) with their KV `kv_slots` in `namespace`; returns how many leading
        tokens' slots the cache did not take (already cached: they stay the caller's, who must free them). A
        subclass's cached node may take the caller's slots of its tokens (`_insert_over`); the cache then owns
        every slot from there on and frees the duplicates past it itself."""
        key = np.asarray(token_ids, np.int32)
        value = np.asarray(kv_slots, np.int32)
        assert len(key) == len(value) and len(key) % self.page_size == 0
        if not len(key):
            return 0
        node, done, taken_from = self._root_of(namespace, create=True), 0, None
        now = time.monotonic()
        while done < len(key):
            rest = key[done:]
            child = node.children.get(self._child_key(rest))
            if child is None:
                self._add_suffix(node, rest, value[done:])
                return done if taken_from is None else taken_from
            child.last_access_time = now
            n = self._align(_common_len(child.key, rest))
            if n < len(child.key):
                child = self._split(child, n)
            if self._insert_over(child, value[done:done + n]):
                taken_from = done if taken_from is None else taken_from
            elif taken_from is not None:
                self.free_slots(value[done:done + n])
            node, done = child, done + n
        return done if taken_from is None else taken_from

    def _add_suffix(self, parent: TreeNode, key: np.ndarray, value: np.ndarray) -> None:
        """A new leaf under `parent` for the uncached rest of an insert (owns `value`'s pages from now)."""
        parent.children[self._child_key(key)] = self.node_cls(key.copy(), value.copy(), parent)
        self._evictable += len(key)

    def _insert_over(self, node: TreeNode, dup_slots: np.ndarray) -> bool:
        """An insert ran through cached `node`; returns whether the cache took the caller's `dup_slots` of the
        same tokens (here never: they stay the caller's)."""
        return False

    # ------------------------------------------------------------ locking and eviction
    def inc_lock_ref(self, node: Optional[TreeNode]) -> int:
        """Protect the path root..node; returns tokens that moved from evictable to protected (None: no-op)."""
        moved = 0
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                moved += len(node.key)
            node.lock_ref += 1
            node = node.parent
        self._evictable -= moved
        self._protected += moved
        return moved

    def dec_lock_ref(self, node: Optional[TreeNode]) -> int:
        """Undo one `inc_lock_ref`; returns tokens that became evictable again (None: no-op)."""
        moved = 0
        while node is not None and node is not self.root:
            assert node.lock_ref > 0, "unbalanced dec_lock_ref"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                moved += len(node.key)
            node = node.parent
        self._evictable += moved
        self._protected -= moved
        return moved

    def nodes(self) -> List[TreeNode]:
        """Every node except the root."""
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def _leaves(self) -> List[TreeNode]:
        return [n for n in self.nodes() if not n.children]

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until `num_tokens` are freed or none is left.

        Returns the number of tokens freed.
        """
        heap = [n for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self.allocator.free_pages(self._pages(leaf.value))
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key)]
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
            self._drop_empty_namespace(parent)
        return freed

    def evict_namespace(self, namespace: int) -> int:
        """Free every unlocked cached prefix of `namespace` (an unloaded LoRA adapter's: no request can match them
        again) and drop the namespace once empty; returns the tokens freed. Locked nodes stay (their holders
        release them as usual)."""
        ns_root = self._namespaces.get(namespace)
        if ns_root is None:
            return 0
        freed, stack, order = 0, [ns_root], []
        while stack:  # (children after their parents: freed in reverse, leaves first)
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        for node in reversed(order[1:]):
            if node.children or node.lock_ref:
                continue
            self.allocator.free_pages(self._pages(node.value))
            del node.parent.children[self._child_key(node.key)]
            freed += len(node.key)
            self._evictable -= len(node.key)
        self._drop_empty_namespace(ns_root)
        return freed

    def retire(self, tag) -> list:
        """Make every cached prefix unmatchable from now on (the weights that computed its KV were replaced):
        free the unlocked ones, and move the locked ones (their holders keep running on them) into retired
        namespaces, ``("retired", tag, namespace)`` for each namespace they were in, that no new request names.
        A holder's later inserts go there too (its ``cache_namespace`` is the retired key,
        `base_prefix_cache.retired_namespace`); `evict_namespace` frees them once unlocked. Returns the retired
        namespaces' keys (empty when nothing was locked)."""
        self.evict(self._evictable)
        retired = []
        for ns in [k for k in self._namespaces if not is_retired(k)]:
            node = self._namespaces.pop(ns)
            key = retired_namespace(tag, ns)
            del self.root.children[("namespace", ns)]
            self.root.children[("namespace", key)] = node
            self._namespaces[key] = node
            retired.append(key)
        base = [(k, c) for k, c in self.root.children.items()
                if not (isinstance(k, tuple) and k[:1] == ("namespace",))]
        if base:
            key = retired_namespace(tag, None)
            holder = self._root_of(key, create=True)
            for k, child in base:
                del self.root.children[k]
                holder.children[k] = child
                child.parent = holder
                holder.lock_ref += child.lock_ref  # (each lock through a child passes through its new parent)
            retired.append(key)
        return retired

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._protected

    def reset(self) -> None:
        """Free every cached page and empty the tree. Only valid when no request holds a lock."""
        if self._protected:
            raise RuntimeError("cannot reset the radix cache while requests hold locks")
        self.evict(self._evictable)
        assert self._evictable == 0
        self.reset_tree()

    def free_slots(self, kv_slots: np.ndarray) -> None:
        """Return request-owned slots (consecutive positions from a page boundary) to the allocator."""
        self.allocator.free_pages(self._pages(kv_slots))

    def _pages(self, slots: np.ndarray) -> np.ndarray:
        return (slots[::self.page_size] // self.page_size).astype(np.int32)
