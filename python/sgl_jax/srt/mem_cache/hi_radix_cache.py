"""HiRadixCache: a radix cache whose prefixes evicted from the device pool keep their KV in a host-memory pool and
are loaded back, not recomputed, when a request matches them again (SGLang's HiCache,
``--enable-hierarchical-cache``).

A node holds device slots (``value``), host slots (``host_value``), or both. A node with host slots only is
"on host": its parent is on the device or on host, never missing, and its subtree is on host too, so a match runs
through device nodes first and then host nodes, and loading back the host part of a match (`load_back`) makes a
contiguous path device-resident again. When the KV is copied to the host (``--hicache-write-policy``):

- ``write_through``: every node as it is inserted (the host then mirrors the device; eviction only frees);
- ``write_through_selective``: a node once it is matched a second time, and any other node when it is evicted;
- ``write_back``: a node when it is evicted from the device.

Eviction from the device frees least-recently-used unlocked device leaves (device nodes with no device child); a
leaf with a host copy stays in the tree, on host; one whose copy cannot be made (the host pool full of what
cannot go) is dropped with its host subtree. The host pool evicts least-recently-used host leaves (and then
the host copies of device nodes) to make room. Device accounting (`evictable_size`, `protected_size`) counts
device tokens only; host accounting is `host_size`, `host_used_size`, `host_available_size`.

The copies themselves are the caller's (`KVMover`: the model runner moves pages between its device buffers and
host buffers); this class owns only slots. Source: SGLang's HiRadixCache (python/sglang/srt/mem_cache/
hiradix_cache.py), whose node states and write policies these follow.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from typing import List, Optional, Protocol

import numpy as np

from sgl_jax.srt.mem_cache.base_prefix_cache import TokenIds
from sgl_jax.srt.mem_cache.free_list import PageFreeList
from sgl_jax.srt.mem_cache.radix_cache import RadixCache, TreeNode, _common_len
from sgl_jax.srt.mem_cache.swa_allocator import SWAPagedAllocator
from sgl_jax.srt.server_args import HICACHE_WRITE_POLICIES

WRITE_POLICIES = HICACHE_WRITE_POLICIES
SELECTIVE_HITS = 2  # write_through_selective copies a node to host at its second match (SGLang's threshold)


class KVMover(Protocol):
    """Moves KV between the device pool and the host pool; slots are token slots (int32, page-aligned runs of
    whole pages, equal lengths)."""

    def to_host(self, device_slots: np.ndarray, host_slots: np.ndarray) -> None: ...

    def to_device(self, host_slots: np.ndarray, device_slots: np.ndarray) -> None: ...


@dataclasses.dataclass(frozen=True)
class HostTier:
    """What a rank's host tier is built from: the host pool's capacity in tokens, the mover that copies KV between
    the pools (`KVMover`; the model runner's `model_executor/host_kv.HostKVPool`) and the write policy
    (--hicache-write-policy, one of WRITE_POLICIES)."""

    tokens: int
    mover: "KVMover"
    write_policy: str = "write_through"


class HostSlots:
    """The host pool's pages of `page_size` token slots (no padding page: nothing writes the host pool but
    copies). Slots are token indices: page p holds slots [p * page_size, (p + 1) * page_size)."""

    def __init__(self, num_tokens: int, page_size: int):
        self.page_size = page_size
        self.num_pages = num_tokens // page_size
        self.free_list = PageFreeList(np.arange(self.num_pages, dtype=np.int32), self.num_pages, "host KV page")

    @property
    def size(self) -> int:
        return self.num_pages * self.page_size

    def available_size(self) -> int:
        return len(self.free_list) * self.page_size

    def alloc(self, num_tokens: int) -> Optional[np.ndarray]:
        """Slots for `num_tokens` (a multiple of page_size), or None when too few pages are free."""
        pages = self.free_list.take(num_tokens // self.page_size)
        if pages is None:
            return None
        return (pages[:, None] * self.page_size + np.arange(self.page_size, dtype=np.int32)).reshape(-1)

    def free(self, slots: np.ndarray) -> None:
        """Give slots back. Raises ValueError on a page freed twice."""
        pages = (np.asarray(slots, np.int32)[::self.page_size] // self.page_size).astype(np.int32)
        self.free_list.give(pages)


class HiTreeNode(TreeNode):
    """A `TreeNode` with host slots (``host_value``, None: no host copy; ``value`` None: on host only) and its
    match count (``hits``, for write_through_selective)."""

    __slots__ = ("host_value", "hits")

    def __init__(self, key: np.ndarray, value: Optional[np.ndarray], parent: Optional["HiTreeNode"]):
        super().__init__(key, value, parent)
        self.host_value: Optional[np.ndarray] = None
        self.hits = 0


class HiRadixCache(RadixCache):
    """RadixCache with a host tier (module docstring).

    Args:
        req_to_token_pool, allocator, page_size: as RadixCache's.
        host_tokens: the host pool's capacity in tokens (--hicache-ratio x the device pool, or --hicache-size).
        mover: what copies KV between the pools (`KVMover`).
        write_policy: one of WRITE_POLICIES.
    """

    kind = "hiradix"
    node_cls = HiTreeNode

    def __init__(self, req_to_token_pool, allocator, page_size: int, host_tokens: int, mover: KVMover,
                 write_policy: str = "write_through"):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"--hicache-write-policy must be one of {', '.join(WRITE_POLICIES)}, got "
                             f"{write_policy!r}")
        self.host = HostSlots(host_tokens, page_size)
        self.mover = mover
        self.write_policy = write_policy
        self._host_used = 0
        self._backups_on = True
        self._pinned: set = set()  # host nodes being loaded back (the host pool must not evict them)
        self.num_host_hit_tokens = 0  # tokens loaded back instead of recomputed
        self.num_host_written_tokens = 0  # tokens copied to the host pool
        super().__init__(req_to_token_pool, allocator, page_size)

    @classmethod
    def create(cls, req_to_token_pool, allocator, page_size: int, sliding_window: Optional[int] = None,
               host_tier: Optional[HostTier] = None) -> "HiRadixCache":
        """The registry's factory: a host tier over a single (full) pool.

        Raises:
            ValueError: no `host_tier`, a host pool of less than one page, or a hybrid SWA allocator (its SWA pool's
                KV has no host copy here: with --enable-hierarchical-cache every layer reads one pool).
        """
        if host_tier is None:
            raise ValueError("the \"hiradix\" prefix cache needs a host tier (--enable-hierarchical-cache)")
        if isinstance(allocator, SWAPagedAllocator):
            raise ValueError("the hierarchical cache keeps one KV pool; a hybrid SWA pool needs \"swa_radix\"")
        if host_tier.tokens < page_size:
            raise ValueError(f"the host KV pool ({host_tier.tokens} tokens) is less than one page ({page_size}): "
                             "raise --hicache-ratio or --hicache-size")
        return cls(req_to_token_pool, allocator, page_size, host_tier.tokens, host_tier.mover,
                   host_tier.write_policy)

    # ------------------------------------------------------------ accounting
    def host_size(self) -> int:
        return self.host.size

    def host_used_size(self) -> int:
        """Host tokens held by nodes (on host, or copies of device nodes)."""
        return self._host_used

    def host_available_size(self) -> int:
        return self.host.available_size()

    # ------------------------------------------------------------ tree basics
    def _split(self, child: HiTreeNode, n: int) -> HiTreeNode:
        upper = self.node_cls(child.key[:n], None if child.value is None else child.value[:n], child.parent)
        upper.lock_ref, upper.hits = child.lock_ref, child.hits
        upper.last_access_time = child.last_access_time
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:n], child.host_value[n:]
        upper.children = {self._child_key(child.key[n:]): child}
        child.parent.children[self._child_key(child.key)] = upper
        child.key, child.parent = child.key[n:], upper
        if child.value is not None:
            child.value = child.value[n:]
        return upper

    def _matchable(self, node: HiTreeNode) -> bool:
        """`match_prefix` stops at the first node on host (`load_back` brings those in first)."""
        return node.value is not None

    def _matched(self, node: HiTreeNode) -> None:
        node.hits += 1
        if self.write_policy == "write_through_selective" and node.hits >= SELECTIVE_HITS:
            self._backup(node)

    def _insert_over(self, node: HiTreeNode, dup_slots: np.ndarray) -> bool:
        """A node on host that an insert runs through takes the caller's slots: it is on the device again (its
        host copy kept). Nodes on host are never locked."""
        if node.value is not None:
            return False
        node.value = dup_slots.copy()
        self._evictable += len(dup_slots)
        return True

    def _add_suffix(self, parent: HiTreeNode, key: np.ndarray, value: np.ndarray) -> None:
        super()._add_suffix(parent, key, value)
        if self.write_policy == "write_through":
            self._backup(parent.children[self._child_key(key)])

    # ------------------------------------------------------------ host copies
    def _backup(self, node: HiTreeNode) -> bool:
        """Copy device node `node` to the host pool (making room there); False when there is none."""
        if node.host_value is not None:
            return True
        if not self._backups_on or node.value is None:
            return False
        slots = self._host_alloc(len(node.key), keep=node)
        if slots is None:
            return False
        self.mover.to_host(node.value, slots)
        node.host_value = slots
        self._host_used += len(slots)
        self.num_host_written_tokens += len(slots)
        return True

    def _host_alloc(self, n: int, keep: Optional[HiTreeNode] = None) -> Optional[np.ndarray]:
        """Host slots for n tokens, evicting least-recently-used host leaves, then host copies of device nodes
        (never `keep`'s path or a node being loaded back), until they fit; None when they cannot."""
        slots = self.host.alloc(n)
        if slots is not None:
            return slots
        protected = set()
        while keep is not None:
            protected.add(id(keep))
            keep = keep.parent
        protected |= self._pinned
        nodes = self.nodes()
        leaves = [x for x in nodes if x.value is None and not x.children and id(x) not in protected]
        copies = [x for x in nodes if x.value is not None and x.host_value is not None and id(x) not in protected]
        heapq.heapify(leaves)
        while self.host.available_size() < n and leaves:
            leaf = heapq.heappop(leaves)
            parent = self._drop_host_node(leaf)
            if parent.value is None and not parent.children and parent is not self.root and id(parent) not in protected:
                heapq.heappush(leaves, parent)
        for x in sorted(copies):
            if self.host.available_size() >= n:
                break
            if x.children and any(c.value is None for c in x.children.values()):
                continue  # (its host children need it on host to be loaded back through it)
            self._free_host(x)
        return self.host.alloc(n)

    def _free_host(self, node: HiTreeNode) -> None:
        self.host.free(node.host_value)
        self._host_used -= len(node.host_value)
        node.host_value = None

    def _drop_host_node(self, node: HiTreeNode) -> HiTreeNode:
        """Remove host leaf `node` from the tree; returns its parent."""
        self._free_host(node)
        parent = node.parent
        del parent.children[self._child_key(node.key)]
        self._drop_empty_namespace(parent)
        return parent

    def _drop_host_subtree(self, node: HiTreeNode) -> None:
        """Free the host slots of `node`'s descendants on host and remove them (children before parents)."""
        for child in list(node.children.values()):
            if child.value is None:
                self._drop_host_subtree(child)
                self._drop_host_node(child)

    # ------------------------------------------------------------ eviction and load-back
    def _device_leaf(self, node: HiTreeNode) -> bool:
        return (node.value is not None and node.lock_ref == 0 and node is not self.root
                and not any(c.value is not None for c in node.children.values()) and len(node.key) > 0)

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device tokens if possible (least recently used device leaves first); a leaf
        copied to host stays there (write_back and write_through_selective copy it now). Returns tokens freed."""
        heap = [n for n in self.nodes() if self._device_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            if self.write_policy != "write_through":
                self._backup(leaf)
            self.allocator.free_pages(self._pages(leaf.value))
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            if leaf.host_value is not None:
                leaf.value = None
            else:
                self._drop_host_subtree(leaf)
                del parent.children[self._child_key(leaf.key)]
                self._drop_empty_namespace(parent)
            if self._device_leaf(parent):
                heapq.heappush(heap, parent)
        return freed

    def host_match_len(self, token_ids: TokenIds, namespace: Optional[int] = None) -> int:
        """Tokens of `token_ids` past the device match that the host pool holds (what `load_back` would load)."""
        return (self.prefix_match_len(token_ids, namespace, include_unmatchable=True)
                - self.prefix_match_len(token_ids, namespace))

    def load_back(self, token_ids: TokenIds, namespace: Optional[int] = None) -> int:
        """Make the host part of `token_ids`' match device-resident again: device pages for its nodes (evicting
        others if needed; never the match's own device part), the KV copied in. Returns the tokens loaded (0
        when nothing was on host or the device has no room)."""
        key = np.asarray(token_ids, np.int32)[:self._align(len(token_ids))]
        node = self._root_of(namespace, create=False)
        path: List[HiTreeNode] = []
        while node is not None and len(key):
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            n = self._align(_common_len(child.key, key))
            if n == 0:
                break
            if child.value is None:
                if n < len(child.key):
                    child = self._split(child, n)
                path.append(child)
            elif path:
                break
            node, key = child, key[n:]
            if n < len(child.key):
                break
        if not path:
            return 0
        total = sum(len(x.key) for x in path)
        anchor = path[0].parent
        self.inc_lock_ref(anchor)  # (the device part of the match stays while room is made)
        self._pinned = {id(x) for x in path}
        try:
            pages = self.allocator.alloc_pages(total // self.page_size)
            if pages is None:
                self.evict(total - self.allocator.available_size())
                pages = self.allocator.alloc_pages(total // self.page_size)
            if pages is None:
                return 0
            slots = (pages[:, None] * self.page_size + np.arange(self.page_size, dtype=np.int32)).reshape(-1)
            try:
                self.mover.to_device(np.concatenate([x.host_value for x in path]), slots)
            except Exception:
                self.allocator.free_pages(pages)
                raise
            now, start = time.monotonic(), 0
            for x in path:
                x.value = slots[start:start + len(x.key)]
                x.last_access_time = now
                start += len(x.key)
            self._evictable += total
        finally:
            self._pinned = set()
            self.dec_lock_ref(anchor)
        self.num_host_hit_tokens += total
        return total

    # ------------------------------------------------------------ dropping everything
    def _drop_all_host(self, under: Optional[HiTreeNode] = None) -> None:
        """Drop every host copy and node on host (under `under`, default everywhere): their KV is stale. The nodes
        on host hang below device nodes (or the root), so dropping each device node's host subtrees gets all."""
        for node in self._subtree(self.root if under is None else under):
            if node.value is None:
                continue  # (dropped with its device ancestor's host subtree)
            if node.host_value is not None:
                self._free_host(node)
            self._drop_host_subtree(node)

    def _subtree(self, node: HiTreeNode) -> List[HiTreeNode]:
        out, stack = [], [node]
        while stack:
            x = stack.pop()
            out.append(x)
            stack.extend(x.children.values())
        return out

    def retire(self, tag) -> list:
        """RadixCache's retire, the host tier emptied first (its KV came from the old weights too)."""
        self._drop_all_host()
        self._backups_on = False
        try:
            return super().retire(tag)
        finally:
            self._backups_on = True

    def evict_namespace(self, namespace) -> int:
        ns_root = self._namespaces.get(namespace)
        if ns_root is None:
            return 0
        self._drop_all_host(ns_root)
        self._backups_on = False
        try:
            return super().evict_namespace(namespace)
        finally:
            self._backups_on = True

    def reset(self) -> None:
        """Free every cached page of both pools and empty the tree. Only valid when no request holds a lock."""
        self._drop_all_host()
        self._backups_on = False
        try:
            super().reset()
        finally:
            self._backups_on = True
