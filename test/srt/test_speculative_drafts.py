"""The n-gram drafter's trie and draft trees (speculative/ngram_cache.py) and the draft-tree layout and greedy
acceptance (speculative/draft_tree.py), on host arrays.

References: a brute-force greedy walk over every root path for `verify_greedy` (hypothesis-generated trees and
targets); for `verify_sampled`, the exact distribution of a toy language model's first tokens (chi-square over
seeded draws, a statistic that must also reject a wrong distribution); for the drafter, hand-built token streams
whose continuations are known (a copied passage, two continuations of one prefix seen with different counts), and
its capacity bound under a stream that overflows it; `first_chain` on a hand-built tree; for `TopkTree` (top-k
drafts of a draft model or EAGLE head), the same search written over whole token paths.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_jax.srt.speculative.draft_tree import TopkTree, check_tree, first_chain, tree_depths, tree_mask, \
    verify_greedy, verify_sampled
from sgl_jax.srt.speculative.ngram_cache import NgramCache, NgramConfig


def cache(**kw) -> NgramCache:
    return NgramCache(NgramConfig(**kw))


def chain_of(tokens, parents) -> list:
    """The tokens along the chain from the root when the tree is one chain (asserting it is)."""
    assert list(parents[1:]) == list(range(len(parents) - 1)), parents
    return [int(t) for t in tokens[1:]]


def test_a_copied_passage_is_drafted_as_a_chain():
    passage = list(range(100, 160))
    c = cache(num_draft_tokens=8)
    c.insert_prompt([1, 2, 3] + passage + [4, 5])
    tokens, parents = c.draft([7, 8] + passage[:20])  # the request is copying the passage, 20 tokens in
    assert tokens[0] == passage[19] and parents[0] == -1
    assert chain_of(tokens, parents) == passage[20:27]
    check_tree(parents)


def test_no_match_pads_with_token_0_under_the_root():
    c = cache(num_draft_tokens=5)
    c.insert_prompt([10, 11, 12, 13])
    tokens, parents = c.draft([50, 51])
    assert tokens.tolist() == [51, 0, 0, 0, 0] and parents.tolist() == [-1, 0, 0, 0, 0]


def test_bfs_widens_for_short_matches_and_takes_the_most_recent_first():
    # after "5 6" came 7 (seen first) and then 9 (seen last); only the 1-token suffix "6" matches the context
    c = cache(num_draft_tokens=4, min_bfs_breadth=1, max_bfs_breadth=4, max_match_window=3, branch_length=4)
    c.insert_prompt([5, 6, 7, 8])
    c.insert_prompt([5, 6, 9, 10])
    tokens, parents = c.draft([42, 6])
    assert tokens[1:3].tolist() == [9, 7] and parents[1:3].tolist() == [0, 0]  # siblings, most recent first
    # the 3-token match "4 5 6" exists only on the second path: breadth min_bfs_breadth, a chain
    c2 = cache(num_draft_tokens=4, min_bfs_breadth=1, max_bfs_breadth=4, max_match_window=3, branch_length=5)
    c2.insert_prompt([4, 5, 6, 7, 8])
    c2.insert_prompt([3, 5, 6, 9, 10])
    tokens, parents = c2.draft([4, 5, 6])
    assert tokens[1:3].tolist() == [7, 8] and parents[1:3].tolist() == [0, 1]


@pytest.mark.parametrize("breadth", [1, 10])
def test_prob_drafts_the_most_counted_continuation_first(breadth):
    c = cache(num_draft_tokens=3, match_type="PROB", branch_length=4, max_match_window=3, max_bfs_breadth=breadth)
    for _ in range(3):
        c.insert_prompt([5, 6, 7, 8])
    c.insert_prompt([5, 6, 9, 10])  # 9 is the most recent, 7 the most counted
    tokens, parents = c.draft([6])
    assert tokens.tolist() == [6, 7, 8] and parents.tolist() == [-1, 0, 1]


def test_insert_tail_adds_the_newest_tokens():
    c = cache(num_draft_tokens=3, branch_length=4, max_match_window=2)
    c.insert_tail([1, 2, 3, 4, 5, 6])  # the last 4 tokens: 3 4 5 6
    assert chain_of(*c.draft([3, 4])) == [5, 6]
    assert c.draft([1, 2])[0].tolist() == [2, 0, 0]  # older than the tail: not inserted


def test_capacity_is_never_exceeded_and_the_oldest_paths_go_first():
    c = cache(num_draft_tokens=4, capacity=64, branch_length=4, max_match_window=3)
    rng = np.random.default_rng(0)
    c.insert_prompt([900, 901, 902, 903, 904])
    for _ in range(40):
        c.insert_prompt(rng.integers(0, 50, 12).tolist())
        assert len(c) <= 64
    assert c.draft([900, 901])[0].tolist() == [901, 0, 0, 0]  # evicted
    recent = [700, 701, 702, 703]
    c.insert_prompt(recent)
    assert chain_of(*c.draft([700])) == [701, 702, 703]
    # every node kept is reachable from the root (eviction removed leaves only)
    seen, stack = 0, [NgramCache.ROOT]
    while stack:
        kids = c._kids[stack.pop()] or {}
        seen += len(kids)
        stack.extend(kids.values())
    assert seen == len(c)


@pytest.mark.parametrize("bad, flag", [
    (dict(num_draft_tokens=1), "--speculative-num-draft-tokens"),
    (dict(min_match_window=5, max_match_window=4), "--speculative-ngram-min-match-window-size"),
    (dict(max_match_window=18, branch_length=18), "--speculative-ngram-branch-length"),
    (dict(min_bfs_breadth=3, max_bfs_breadth=2), "--speculative-ngram-max-bfs-breadth"),
    (dict(match_type="DFS"), "--speculative-ngram-match-type"),
    (dict(capacity=4), "--speculative-ngram-capacity"),
])
def test_invalid_settings_name_the_flag(bad, flag):
    with pytest.raises(ValueError, match=flag):
        NgramConfig(**bad).validate()


def test_tree_layout():
    parents = np.array([-1, 0, 0, 1, 3, 2])
    assert tree_depths(parents).tolist() == [0, 1, 1, 2, 3, 2]
    mask = tree_mask(parents)
    assert mask[4].tolist() == [True, True, False, True, True, False]
    assert mask[5].tolist() == [True, False, True, False, False, True]
    for bad in ([0, 0], [-1, 1], [-1, 0, 2], [-1, -1]):
        with pytest.raises(ValueError):
            check_tree(np.array(bad))


@st.composite
def trees(draw):
    n = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [draw(st.integers(0, 3)) for _ in range(n)]
    target = [draw(st.integers(0, 3)) for _ in range(n)]
    return np.array(tokens), np.array(parents), np.array(target)


def brute_force_accept(tokens, parents, target) -> list:
    """Greedy acceptance by its definition: follow the root path whose every draft token is the target's token
    after its parent, the first such child in slot order at each step."""
    path = [0]
    while True:
        kids = [i for i in range(1, len(parents)) if parents[i] == path[-1] and tokens[i] == target[path[-1]]]
        if not kids:
            return path
        path.append(min(kids))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(trees())
def test_verify_greedy_matches_the_definition(tree):
    tokens, parents, target = tree
    accepted, emitted = verify_greedy(tokens, parents, target)
    assert accepted == brute_force_accept(tokens, parents, target)
    assert emitted == [int(tokens[i]) for i in accepted[1:]] + [int(target[accepted[-1]])]
    depths = tree_depths(parents)
    assert [int(depths[i]) for i in accepted] == list(range(len(accepted)))  # one root path


V_TOY = 5
TOY_TREE = np.array([-1, 0, 0, 1, 1, 2, 0])  # the drafter's tree shape: three candidates at the root


def _stable_seed(key: tuple) -> int:
    """A seed from `key` that is the same in every process (``hash`` of a str is salted per process)."""
    return zlib.crc32(repr(key).encode())


def toy_lm(prefix: tuple) -> np.ndarray:
    """A toy language model: the next-token distribution (float64[V_TOY]) after `prefix`, fixed per prefix."""
    return np.random.default_rng(_stable_seed(prefix)).dirichlet(np.full(V_TOY, 0.7))


def toy_draft(prefix: tuple) -> np.ndarray:
    """A deterministic drafter (no probabilities, as the n-gram one): tree tokens after `prefix`."""
    rng = np.random.default_rng(_stable_seed(("draft",) + prefix))
    tokens = rng.integers(0, V_TOY, len(TOY_TREE))
    tokens[0] = prefix[-1]
    return tokens


def speculative_tokens(rng, n: int, verify=verify_sampled) -> tuple:
    """The first `n` tokens after the prompt (0,) generated by draft-and-verify rounds."""
    out = [0]
    while len(out) < n + 1:
        tokens = toy_draft(tuple(out))
        probs = []
        for i in range(len(TOY_TREE)):
            path, j = [], i
            while j > 0:
                path.insert(0, int(tokens[j]))
                j = TOY_TREE[j]
            probs.append(toy_lm(tuple(out + path)))
        _, emitted = verify(tokens, TOY_TREE, np.array(probs), rng)
        out += emitted
    return tuple(out[1:n + 1])


def test_sampled_verification_keeps_the_target_distribution():
    """5,000 seeded runs: the joint distribution of the first two tokens equals the toy model's (chi-square z <
    6; the same counts against the first token's distribution taken twice, a wrong law, give z > 6), and drafts
    are accepted (the speed-up exists)."""
    from test_sampling_draw import chi_square_z

    rng = np.random.default_rng(0)
    runs = 5000
    counts = np.zeros((V_TOY, V_TOY))
    for _ in range(runs):
        a, b = speculative_tokens(rng, 2)
        counts[a, b] += 1
    exact = np.array([[toy_lm((0,))[a] * toy_lm((0, a))[b] for b in range(V_TOY)] for a in range(V_TOY)])
    assert abs(exact.sum() - 1) < 1e-9
    assert chi_square_z(counts.ravel(), exact.ravel()) < 6.0
    wrong = np.outer(toy_lm((0,)), toy_lm((0,)))  # the second token as if it did not depend on the first
    assert chi_square_z(counts.ravel(), wrong.ravel()) > 6.0
    # a round emits more than one token on average: accepted drafts
    rounds = [len(verify_sampled(toy_draft((0,)), TOY_TREE, np.array([toy_lm((0,))] * len(TOY_TREE)), rng)[1])
              for _ in range(200)]
    assert np.mean(rounds) > 1.2


def test_first_chain_follows_each_slots_first_child():
    tokens = np.array([7, 1, 2, 3, 4, 5, 6])
    parents = np.array([-1, 0, 0, 1, 1, 3, 2])  # slot 1's first child is 3, whose is 5
    chain, chain_parents = first_chain(tokens, parents)
    assert chain.tolist() == [7, 1, 3, 5] and chain_parents.tolist() == [-1, 0, 1, 2]
    assert first_chain(np.array([9]), np.array([-1]))[0].tolist() == [9]


def toy_logprobs(path: tuple, vocab: int) -> np.ndarray:
    """A toy draft model: log-probabilities of the next token after `path` (a deterministic function of it)."""
    logits = np.random.default_rng(zlib.crc32(repr(path).encode())).normal(size=vocab) * 2.0
    return logits - np.logaddexp.reduce(logits)


def reference_topk_search(root: int, topk: int, steps: int, vocab: int):
    """SGLang's EAGLE draft search over whole paths: (each step's frontier paths, every candidate path -> score)."""
    frontier, scores, fronts = [(root,)], {}, []
    for _ in range(steps):
        fronts.append(frontier)
        cands = []
        for path in frontier:
            lp = toy_logprobs(path, vocab)
            for tok in np.argsort(-lp, kind="stable")[:topk]:
                child = path + (int(tok),)
                scores[child] = scores.get(path, 0.0) + float(lp[tok])
                cands.append(child)
        frontier = sorted(cands, key=lambda c: -scores[c])[:topk]
    return fronts, scores


def tree_paths(tokens, parents) -> list:
    """Each slot's token path from the root."""
    paths = []
    for i, p in enumerate(parents):
        paths.append((int(tokens[i]),) if p < 0 else paths[p] + (int(tokens[i]),))
    return paths


@settings(max_examples=60, deadline=None)
@given(topk=st.integers(1, 4), steps=st.integers(1, 4), num_slots=st.integers(2, 32), vocab=st.integers(4, 9))
def test_topk_tree_matches_the_search_over_paths(topk, steps, num_slots, vocab):
    """Each step feeds the frontier's paths (and only their prefixes), the frontier is the k best candidates, and
    the final tree is the best num_slots - 1 candidates, parent-first with each slot's children best first."""
    topk = min(topk, vocab)
    fronts, scores = reference_topk_search(7, topk, steps, vocab)
    tree = TopkTree(7, topk)
    for front in fronts:
        tokens, parents, rows = tree.fed()
        check_tree(parents)
        paths = tree_paths(tokens, parents)
        assert [paths[r] for r in rows] == front
        assert set(paths) == {f[:d] for f in front for d in range(1, len(f) + 1)}  # the frontier's prefixes only
        lps = [toy_logprobs(p, vocab) for p in front]
        best = [np.argsort(-lp, kind="stable")[:topk] for lp in lps]
        tree.expand(np.asarray(best), np.asarray([lp[b] for lp, b in zip(lps, best)]))
    tokens, parents = tree.final(num_slots)
    check_tree(parents)
    paths = tree_paths(tokens, parents)
    want = sorted(scores, key=lambda c: -scores[c])[:num_slots - 1]
    assert len(paths) == 1 + len(want) and set(paths[1:]) == set(want)
    for node in range(len(paths)):  # children best first
        kids = [scores[paths[c]] for c in range(len(paths)) if parents[c] == node]
        assert kids == sorted(kids, reverse=True)
    if topk == 1:  # a chain: the draft's greedy tokens
        assert len(paths) == min(num_slots, steps + 1) and list(parents) == list(range(-1, len(paths) - 1))


def test_topk_tree_rejects_wrong_shapes():
    tree = TopkTree(3, 2)
    with pytest.raises(ValueError, match="expected \\[1, 2\\] candidates"):
        tree.expand(np.zeros((2, 2), np.int32), np.zeros((2, 2)))
    with pytest.raises(ValueError, match="top-k must be >= 1"):
        TopkTree(3, 0)
