"""Draft trees for speculative decoding: their verify-step layout and acceptance, greedy and sampled (host
arrays; `verify_sampled` is also the reference for a device version).

A draft tree of n slots is (tokens int32[n], parents int32[n]): slot 0 is the root -- the request's last token,
whose KV the verify step computes as its first query --, ``parents[0] = -1`` and ``parents[i] < i`` (a parent is laid
out before its children). A chain (top-k 1) has ``parents[i] = i - 1``. The verify step runs all n slots as queries
of one forward: slot i at position ``seq_len + depth[i]``, attending to the request's committed KV and to its own
ancestors in the tree (`tree_mask`), SGLang's tree verification (its EAGLE and n-gram workers; Miao et al. 2024,
SpecInfer).
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from sgl_jax.srt.server_args import MAX_DRAFT_TOKENS

NO_TREE = -1  # the tree bits of a query that is no draft slot: the causal mask alone
MAX_TREE_SLOTS = MAX_DRAFT_TOKENS  # slots per tree: one bit each in an int32


def check_tree(parents: np.ndarray) -> None:
    """Raises ValueError unless ``parents`` (int32[n]) is a tree laid out parent-first with slot 0 as its root."""
    parents = np.asarray(parents)
    n = len(parents)
    if n == 0 or parents[0] != -1:
        raise ValueError("a draft tree needs its root at slot 0 (parents[0] = -1)")
    idx = np.arange(1, n)
    if np.any(parents[1:] < 0) or np.any(parents[1:] >= idx):
        raise ValueError("every draft slot's parent must be an earlier slot (0 <= parents[i] < i)")


def tree_depths(parents: np.ndarray) -> np.ndarray:
    """int32[n]: each slot's depth below the root (the root 0); its query position is seq_len + depth. A forest
    (more slots with parent -1, laid out parent-first: an EAGLE head's tree step, scheduler/speculative/eagle_draft.py)
    has each of its roots at depth 0."""
    parents = np.asarray(parents)
    depth = np.zeros(len(parents), np.int32)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1 if parents[i] >= 0 else 0
    return depth


def tree_mask(parents: np.ndarray) -> np.ndarray:
    """bool[n, n]: row i marks the slots query i attends to among the drafts (its ancestors and itself; in a
    forest, only its own tree's)."""
    parents = np.asarray(parents)
    n = len(parents)
    mask = np.zeros((n, n), bool)
    for i in range(n):
        if parents[i] >= 0:
            mask[i] = mask[parents[i]]
        mask[i, i] = True
    return mask


def tree_bits(parents: np.ndarray) -> np.ndarray:
    """int32[n]: each slot's row of `tree_mask` packed into one int32 (bit j: slot j is an ancestor or itself), as
    `ForwardBatch.tree_bits` and the attention kernels take it (slot 31 is the sign bit). Raises ValueError for
    more than MAX_TREE_SLOTS slots."""
    if len(parents) > MAX_TREE_SLOTS:
        raise ValueError(f"a draft tree has at most {MAX_TREE_SLOTS} slots, got {len(parents)}")
    mask = tree_mask(parents)
    weights = np.left_shift(np.uint64(1), np.arange(len(parents), dtype=np.uint64))
    return (mask.astype(np.uint64) * weights).sum(1).astype(np.uint32).view(np.int32)


def first_chain(tokens: np.ndarray, parents: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The tree's chain from the root through each slot's first child (its most likely continuation, the drafters
    put it first): (tokens int32[m], parents int32[m]) with ``parents[i] = i - 1``. A chain's slot order is its
    depth order, which sliding-window attention needs (a window is measured on the KV position)."""
    children = _children(parents)
    path = [0]
    while children[path[-1]]:
        path.append(children[path[-1]][0])
    return np.asarray(tokens, np.int32)[path], chain_parents(len(path))


def chain_parents(n: int) -> np.ndarray:
    """int32[n]: the parents of a chain of n slots (slot 0 the root, ``parents[i] = i - 1``)."""
    return np.arange(-1, n - 1, dtype=np.int32)


def _children(parents: np.ndarray) -> List[List[int]]:
    """Each slot's children, in slot order."""
    children: List[List[int]] = [[] for _ in range(len(parents))]
    for i in range(1, len(parents)):
        children[int(parents[i])].append(i)
    return children


def verify_greedy(tokens: np.ndarray, parents: np.ndarray, target: np.ndarray) -> Tuple[List[int], List[int]]:
    """Greedy acceptance of a draft tree (SGLang's ``verify_tree_greedy``).

    Args:
        tokens, parents: the tree (int32[n] each). target: int32[n], the target model's greedy token after each
            slot (the argmax of the verify step's logits at that query).
    Returns:
        (accepted slots: the root, then each accepted draft slot along one root path; emitted tokens: the accepted
        drafts' tokens and then the bonus token, the target's token after the last accepted slot). From the root,
        each step takes the first child (in slot order) whose token equals the target's token after the current
        slot, so the output is token for token what greedy decoding without speculation gives.
    """
    children = _children(parents)
    accepted, emitted, last = [0], [], 0
    while True:
        want = int(target[last])
        nxt = next((c for c in children[last] if int(tokens[c]) == want), None)
        if nxt is None:
            break
        accepted.append(nxt)
        emitted.append(want)
        last = nxt
    emitted.append(int(target[last]))
    return accepted, emitted


def verify_sampled(tokens: np.ndarray, parents: np.ndarray, probs: np.ndarray,
                   rng: np.random.Generator) -> Tuple[List[int], List[int]]:
    """Acceptance of a draft tree under sampling (temperature > 0) that keeps the target's distribution exactly:
    speculative sampling (Leviathan et al. 2023) for a drafter that proposes tokens without probabilities (the
    n-gram drafter: each draft is a point mass), over a tree as SpecInfer's multi-candidate verification (Miao et
    al. 2024) and SGLang's ``tree_speculative_sampling_target_only``.

    At the current slot (the root first) with target distribution p, each child in slot order is accepted with
    probability p(child's token) / sum(p); a rejected child's token is removed from p (the residual
    max(p - q, 0) for a point mass q). The first accepted child becomes the current slot; when every child is
    rejected (or there are none) the bonus token is drawn from what is left of p. The emitted tokens are
    therefore distributed as tokens sampled one at a time from the target.

    Args:
        tokens, parents: the tree (int32[n] each, see the module docstring).
        probs: float[n, V]: the target's next-token distribution after each slot (temperature, top-k/top-p and
            penalties applied; rows need not be normalised, each must have positive mass).
        rng: the random stream (one uniform per child tested, one draw for the bonus token).
    Returns:
        (accepted slots from the root, emitted tokens: the accepted drafts' tokens then the bonus token).
    """
    children = _children(parents)
    accepted, emitted, node = [0], [], 0
    while True:
        p = np.asarray(probs[node], np.float64).copy()
        chosen = None
        for c in children[node]:
            t = int(tokens[c])
            if rng.random() * p.sum() < p[t]:
                chosen = c
                break
            p[t] = 0.0
        if chosen is None:
            emitted.append(int(rng.choice(len(p), p=p / p.sum())))
            return accepted, emitted
        accepted.append(chosen)
        emitted.append(int(tokens[chosen]))
        node = chosen


class TopkTree:
    """A draft tree grown by a drafter that proposes the top-k tokens at each step, with their log-probabilities
    (--speculative-eagle-topk k > 1: EAGLE, EAGLE-3 and STANDALONE; SGLang's EAGLE worker and its
    ``organize_draft_results``, after EAGLE-2's dynamic draft tree, Li et al. 2024).

    Nodes carry a score: the draft's log-probability of the path from the root. Step d expands each node of the
    frontier (the root first) into its k most likely next tokens; the new frontier is the k best of those k x k
    candidates by score. After the last step, `final` keeps the best `n - 1` of every candidate ever proposed:
    scores only fall along a path, so the kept set holds each kept node's parent too (ties are broken towards
    earlier candidates, which are never children of later ones).

    Host data only: the drafter runs the forwards (`fed`: the nodes its next step feeds, laid out as a tree) and
    hands each step's top-k back (`expand`).

    Args:
        root_token: the request's last token (slot 0 of every tree).
        topk: candidates per node and frontier size (>= 1).
    """

    def __init__(self, root_token: int, topk: int):
        if topk < 1:
            raise ValueError(f"top-k must be >= 1, got {topk}")
        self.topk = topk
        self.tokens: List[int] = [int(root_token)]
        self.parents: List[int] = [-1]
        self.scores: List[float] = [0.0]
        self.frontier: List[int] = [0]

    def fed_nodes(self) -> List[int]:
        """The node ids `fed` lays out, in its order: the root and every frontier node's ancestors, parent-first
        (node ids grow with depth). Every one but the root was fed in the step before too (a frontier node's
        parent was on the frontier then)."""
        keep = set()
        for node in self.frontier:
            while node >= 0 and node not in keep:
                keep.add(node)
                node = self.parents[node]
        return sorted(keep)

    def fed(self) -> Tuple[np.ndarray, np.ndarray, List[int]]:
        """The tree the drafter's next step feeds: the root and every frontier node's ancestors, parent-first
        (tokens int32[m], parents int32[m]), and where each frontier node sits in it (the rows whose next-token
        top-k `expand` takes, in frontier order). m <= 1 + k x steps so far."""
        order = self.fed_nodes()
        at = {node: i for i, node in enumerate(order)}
        tokens = np.asarray([self.tokens[n] for n in order], np.int32)
        parents = np.asarray([at[self.parents[n]] if self.parents[n] >= 0 else -1 for n in order], np.int32)
        return tokens, parents, [at[n] for n in self.frontier]

    def expand(self, child_tokens: np.ndarray, child_logprobs: np.ndarray) -> None:
        """One draft step: row i of `child_tokens` / `child_logprobs` (int / float [len(frontier), k], each row
        best first) are the frontier's i-th node's k most likely next tokens and their log-probabilities."""
        child_tokens = np.asarray(child_tokens)
        child_logprobs = np.asarray(child_logprobs, np.float64)
        if child_tokens.shape != (len(self.frontier), self.topk) or child_logprobs.shape != child_tokens.shape:
            raise ValueError(f"expected [{len(self.frontier)}, {self.topk}] candidates, got {child_tokens.shape} "
                             f"and {child_logprobs.shape}")
        new = []
        for node, toks, lps in zip(self.frontier, child_tokens, child_logprobs):
            for tok, lp in zip(toks, lps):
                new.append(len(self.tokens))
                self.tokens.append(int(tok))
                self.parents.append(node)
                self.scores.append(self.scores[node] + float(lp))
        # stable: among equal scores the earlier candidate (the better parent's, the better rank's) wins
        self.frontier = sorted(new, key=lambda i: -self.scores[i])[:self.topk]

    def final(self, num_slots: int) -> Tuple[np.ndarray, np.ndarray]:
        """The draft tree to verify: the root and the best ``num_slots - 1`` candidates by score (each with its
        parent), parent-first and each node's children best first (so `first_chain` is the draft's most likely
        path): (tokens int32[m], parents int32[m]), m <= num_slots."""
        best = sorted(range(1, len(self.tokens)), key=lambda i: -self.scores[i])[:max(num_slots - 1, 0)]
        keep = {0}
        for node in best:  # (already closed under parents: see the class docstring; made sure of)
            while node not in keep:
                keep.add(node)
                node = self.parents[node]
        depth = {0: 0}
        for node in sorted(keep):
            if node:
                depth[node] = depth[self.parents[node]] + 1
        order = sorted(keep, key=lambda i: (depth[i], -self.scores[i], i))
        at = {node: i for i, node in enumerate(order)}
        tokens = np.asarray([self.tokens[n] for n in order], np.int32)
        parents = np.asarray([at[self.parents[n]] if n else -1 for n in order], np.int32)
        return tokens[:num_slots], parents[:num_slots]
