"""LFURadixCache: the radix cache that evicts the least frequently used prefix first (``--radix-eviction-policy
lfu``, SGLang's flag; the default, lru, is RadixCache).

Every node counts the finished requests that reused it (``hit_count``: the hand-off calls `record_hit` once
per finished request with the prefix it matched, so neither re-matching a request that waits for room nor a
chunked prefill's re-locks inflate it, as SGLang counts once per request); eviction frees unlocked leaves with
the fewest hits first, least recently used among equals. A prefix many requests share (a system prompt) then outlives one-off prompts that arrived after it, where
LRU would evict it first under a burst of new prompts. Everything else -- page-aligned nodes, locking, the
accounting, the `BasePrefixCache` contract -- is RadixCache's. Kind "lfu_radix" (registry.py); one full pool
only (hybrid SWA memory uses "swa_radix").

Source: SGLang's ``--radix-eviction-policy lfu`` (python/sglang/srt/mem_cache/evict_policy.py); code our own.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from sgl_jax.srt.mem_cache.radix_cache import RadixCache, TreeNode


class LFUTreeNode(TreeNode):
    """A TreeNode with ``hit_count``, the finished requests that reused it; heap order: fewest hits, then least
    recently used."""

    __slots__ = ("hit_count",)

    def __init__(self, key: np.ndarray, value: np.ndarray, parent: Optional["LFUTreeNode"]):
        super().__init__(key, value, parent)
        self.hit_count = 0

    def __lt__(self, other: "LFUTreeNode") -> bool:
        return (self.hit_count, self.last_access_time, self.id) < (other.hit_count, other.last_access_time, other.id)


class LFURadixCache(RadixCache):
    """RadixCache with least-frequently-used eviction (see the module docstring); same arguments."""

    kind = "lfu_radix"

    node_cls = LFUTreeNode

    def record_hit(self, node: Optional[LFUTreeNode]) -> None:
        """Every node of the path root..`node` counts one more hit (a finished request reused it)."""
        while node is not None and node is not self.root:
            node.hit_count += 1
            node = node.parent

    def _split(self, child: LFUTreeNode, n: int) -> LFUTreeNode:
        """RadixCache's split; the new upper node keeps the hits of the node it was cut from."""
        upper = super()._split(child, n)
        upper.hit_count = child.hit_count
        return upper
