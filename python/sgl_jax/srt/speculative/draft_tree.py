"""Draft trees for speculative decoding: their verify-step layout and greedy acceptance (host arrays).

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
    """int32[n]: each slot's depth below the root (the root 0); its query position is seq_len + depth."""
    parents = np.asarray(parents)
    depth = np.zeros(len(parents), np.int32)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def tree_mask(parents: np.ndarray) -> np.ndarray:
    """bool[n, n]: row i marks the slots query i attends to among the drafts (its ancestors and itself)."""
    parents = np.asarray(parents)
    n = len(parents)
    mask = np.zeros((n, n), bool)
    for i in range(n):
        if i:
            mask[i] = mask[parents[i]]
        mask[i, i] = True
    return mask


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
    children: List[List[int]] = [[] for _ in range(len(parents))]
    for i in range(1, len(parents)):
        children[int(parents[i])].append(i)
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
