"""N-gram drafts for speculative decoding (``--speculative-algorithm NGRAM``): a token trie shared by every request.

SGLang's n-gram speculation (its ``cpp_ngram`` trie, here in Python): token sequences are inserted as paths of at
most ``branch_length`` tokens from the root, so a node's children are the tokens that followed its path somewhere
before, each with a count (``freq``). A request's prompt is inserted whole (every window of it: the passages a
code-editing request copies) and, after each verify step, the tail of its prompt + output. To draft, the last
tokens of the request are matched as suffixes of every length from ``max_match_window`` down to
``min_match_window`` and the continuations of every match, longest first, are merged into one draft tree of
``num_draft_tokens`` slots:

- BFS: from each match, a breadth-first walk taking each node's most recently seen children, as many as a breadth
  that is ``min_bfs_breadth`` for the longest match and grows to ``max_bfs_breadth`` for the shortest (a long
  match is a confident chain, a short one a bushy guess), shrinking by one step with each level.
- PROB: the most probable continuations first (a child's probability = its parent's x its share of the count
  among the parent's ``max_bfs_breadth`` most counted children).

A draft is (tokens int32[n], parents int32[n]): slot 0 is the root, the request's last token (its KV not yet
computed: the verify step's first query), ``parents[i] < i`` for every other slot; slots nothing filled hold token 0
under the root (a guess that is accepted only when the target really predicts token 0, so it stays exact).

Memory: at most ``capacity`` nodes; inserting past it evicts the least recently touched paths first. Every
insertion touches a path's nodes deepest first, so a parent is always more recent than its children and the least
recent node is a leaf.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from sgl_jax.srt.server_args import NGRAM_MATCH_TYPES as MATCH_TYPES, ServerArgs, check_ngram_flags


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    """The n-gram drafter's settings (SGLang's ``--speculative-ngram-*`` flags and defaults).

    num_draft_tokens: slots of a draft tree, the root included (``--speculative-num-draft-tokens``; SGLang's default
        for NGRAM is max_match_window). min_match_window / max_match_window: suffix lengths matched (tokens).
    min_bfs_breadth / max_bfs_breadth: children taken per node by BFS (see the module docstring). match_type: "BFS"
    or "PROB". branch_length: the longest path inserted (tokens); also how many tail tokens are inserted after each
    step. capacity: trie nodes kept (``--speculative-ngram-capacity``).
    """

    num_draft_tokens: int = ServerArgs.speculative_ngram_max_match_window_size  # (the defaults are the flags')
    min_match_window: int = ServerArgs.speculative_ngram_min_match_window_size
    max_match_window: int = ServerArgs.speculative_ngram_max_match_window_size
    min_bfs_breadth: int = ServerArgs.speculative_ngram_min_bfs_breadth
    max_bfs_breadth: int = ServerArgs.speculative_ngram_max_bfs_breadth
    match_type: str = ServerArgs.speculative_ngram_match_type
    branch_length: int = ServerArgs.speculative_ngram_branch_length
    capacity: int = ServerArgs.speculative_ngram_capacity

    def validate(self) -> None:
        """Raises ValueError naming the flag when a setting is out of range (`server_args.check_ngram_flags`)."""
        check_ngram_flags(self.num_draft_tokens, self.min_match_window, self.max_match_window, self.min_bfs_breadth,
                          self.max_bfs_breadth, self.branch_length, self.match_type, self.capacity)

    @classmethod
    def from_server_args(cls, args) -> "NgramConfig":
        """The settings ``--speculative-*`` give (`ServerArgs`, validated)."""
        return cls(num_draft_tokens=args.speculative_num_draft_tokens,
                   min_match_window=args.speculative_ngram_min_match_window_size,
                   max_match_window=args.speculative_ngram_max_match_window_size,
                   min_bfs_breadth=args.speculative_ngram_min_bfs_breadth,
                   max_bfs_breadth=args.speculative_ngram_max_bfs_breadth,
                   match_type=args.speculative_ngram_match_type,
                   branch_length=args.speculative_ngram_branch_length, capacity=args.speculative_ngram_capacity)


class NgramCache:
    """The shared token trie and the drafts built from it (see the module docstring). Host-only, one per scheduler
    rank; not thread-safe.

    Args:
        config: `NgramConfig` (validated here; raises ValueError as `NgramConfig.validate`).
    """

    ROOT = 0

    def __init__(self, config: NgramConfig):
        config.validate()
        self.config = config
        # per node id: its children (token -> node, least recently touched first), token, parent, count
        self._kids: List[Optional["collections.OrderedDict[int, int]"]] = [collections.OrderedDict()]
        self._token: List[int] = [-1]
        self._parent: List[int] = [-1]
        self._freq: List[int] = [0]
        self._free: List[int] = []
        self._lru: "collections.OrderedDict[int, None]" = collections.OrderedDict()  # every node but the root

    def __len__(self) -> int:
        """Nodes in the trie (the root not counted)."""
        return len(self._lru)

    def reset(self) -> None:
        """Forget everything (a cache flush)."""
        self.__init__(self.config)

    # ---- insertion
    def insert_prompt(self, tokens: Sequence[int]) -> None:
        """Insert every window of `tokens` (at most branch_length tokens from each position; a request's prompt at
        admission)."""
        b = self.config.branch_length
        for i in range(max(0, len(tokens) - 1)):
            self._insert_path(tokens[i:i + b])

    def insert_tail(self, tokens: Sequence[int]) -> None:
        """Insert the suffixes of the last branch_length tokens of `tokens` that are longer than
        min_match_window (a request's prompt + output after a step, as SGLang's ``batch_put``)."""
        tail = list(tokens[-self.config.branch_length:])
        for i in range(len(tail)):
            if i + self.config.min_match_window < len(tail):
                self._insert_path(tail[i:])

    def _insert_path(self, path: Sequence[int]) -> None:
        if len(path) > self.config.capacity - len(self):
            self._evict(len(path) - (self.config.capacity - len(self)))
        node, touched = self.ROOT, []
        for t in path:
            t = int(t)
            kids = self._kids[node]
            if kids is None:
                kids = self._kids[node] = collections.OrderedDict()
            child = kids.get(t)
            if child is None:
                child = self._new_node(node, t)
                kids[t] = child
            else:
                self._freq[child] += 1
                kids.move_to_end(t)
            touched.append(child)
            node = child
        for child in reversed(touched):  # deepest first: every parent ends more recent than its children
            self._lru.move_to_end(child)

    def _new_node(self, parent: int, token: int) -> int:
        if self._free:
            node = self._free.pop()
            self._kids[node], self._token[node], self._parent[node], self._freq[node] = None, token, parent, 1
        else:
            node = len(self._token)
            self._kids.append(None)
            self._token.append(token)
            self._parent.append(parent)
            self._freq.append(1)
        self._lru[node] = None
        return node

    def _evict(self, n: int) -> None:
        """Remove the `n` least recently touched nodes (leaves, see the module docstring)."""
        for _ in range(n):
            node, _ = self._lru.popitem(last=False)
            assert not self._kids[node], "the least recently touched node has children"
            del self._kids[self._parent[node]][self._token[node]]
            self._kids[node] = None
            self._free.append(node)

    # ---- drafting
    def matches(self, context: Sequence[int]) -> List[Tuple[int, int]]:
        """(trie node, suffix length) of every suffix of `context` found in the trie, longest first, for lengths
        max_match_window down to min_match_window."""
        cfg, out = self.config, []
        for w in range(min(len(context), cfg.max_match_window), cfg.min_match_window - 1, -1):
            node = self.ROOT
            for t in context[len(context) - w:]:
                kids = self._kids[node]
                node = kids.get(int(t), -1) if kids else -1
                if node < 0:
                    break
            if node > 0 and self._kids[node]:
                out.append((node, w))
        return out

    def draft(self, context: Sequence[int], pad: bool = True,
              max_tokens: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
        """The draft tree after `context` (the request's tokens so far; its last is the root): (tokens int32[n],
        parents int32[n]), ``parents[0] = -1`` and ``parents[i] < i``. n = num_draft_tokens (or `max_tokens` when
        smaller); unfilled slots hold token 0 under the root, or, without `pad`, are left out (n is then the
        slots the matches filled, 1 when nothing matched). Raises ValueError for an empty context."""
        if len(context) == 0:
            raise ValueError("drafting needs at least one token of context")
        n = self.config.num_draft_tokens if max_tokens is None else max(1, min(max_tokens,
                                                                                 self.config.num_draft_tokens))
        tree = _DraftTree(int(context[-1]), n)
        for node, w in self.matches(context):
            if tree.full():
                break
            if self.config.match_type == "BFS":
                self._grow_bfs(tree, node, w)
            else:
                self._grow_prob(tree, node)
        return tree.arrays(pad)

    def _grow_bfs(self, tree: "_DraftTree", node: int, w: int) -> None:
        cfg = self.config
        scale = (cfg.max_bfs_breadth - cfg.min_bfs_breadth) / (cfg.max_match_window - cfg.min_match_window + 1)
        queue = collections.deque([(node, 0, (cfg.max_match_window - w) * scale + cfg.min_bfs_breadth)])
        while queue and not tree.full():
            trie_node, slot, breadth = queue.popleft()
            kids = self._kids[trie_node]
            if not kids:
                continue
            for taken, token in enumerate(reversed(kids)):  # most recently seen first
                if taken >= max(1, int(breadth)):
                    break
                child_slot = tree.add(slot, token)
                if child_slot is None:
                    return
                queue.append((kids[token], child_slot, breadth - scale))

    def _grow_prob(self, tree: "_DraftTree", node: int) -> None:
        heap: list = []
        order = 0

        def push_children(trie_node: int, slot: int, p: float) -> None:
            nonlocal order
            kids = self._kids[trie_node]
            if not kids:
                return
            top = sorted(kids.items(), key=lambda kv: -self._freq[kv[1]])[:self.config.max_bfs_breadth]
            total = sum(self._freq[c] for _, c in top)
            for token, child in top:
                order += 1
                heapq.heappush(heap, (-p * self._freq[child] / total, order, token, child, slot))

        push_children(node, 0, 1.0)
        while heap and not tree.full():
            neg_p, _, token, child, slot = heapq.heappop(heap)
            child_slot = tree.add(slot, token)
            if child_slot is None:
                return
            push_children(child, child_slot, -neg_p)


class _DraftTree:
    """A draft tree being built: slots in the order they are added (so a parent precedes its children); a token
    added twice under one parent shares its slot."""

    def __init__(self, root_token: int, size: int):
        self.size = size
        self.tokens, self.parents = [root_token], [-1]
        self.kids: List[Dict[int, int]] = [{}]

    def full(self) -> bool:
        return len(self.tokens) >= self.size

    def add(self, parent: int, token: int) -> Optional[int]:
        """The slot of `token` under `parent` (new, or the one it has); None when the tree is full."""
        slot = self.kids[parent].get(token)
        if slot is not None:
            return slot
        if self.full():
            return None
        slot = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.kids.append({})
        self.kids[parent][token] = slot
        return slot

    def arrays(self, pad: bool = True) -> Tuple[np.ndarray, np.ndarray]:
        pad = self.size - len(self.tokens) if pad else 0
        return (np.asarray(self.tokens + [0] * pad, np.int32), np.asarray(self.parents + [0] * pad, np.int32))
