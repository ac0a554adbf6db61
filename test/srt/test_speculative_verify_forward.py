"""Draft-tree verification in one forward (speculative decoding): a tiny random Llama runs a prompt, then a draft
tree's slots as one extend with per-slot positions (seq_len + depth) and the tree mask (ForwardBatch.tree_bits);
the logits at each slot must equal those of an ordinary forward of the prompt followed by the slot's root path, on
both attention backends (native, and pallas: the TPU kernel in Pallas' interpreter on CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sgl_jax.srt.forward_batch import ForwardBatch, ForwardMode
from sgl_jax.srt.kernels.ragged_paged_attention.common import NO_TREE
from sgl_jax.srt.speculative.draft_tree import tree_depths

from rpa_batches import tree_bits_of
from srt_helpers import save_tiny_llama
from test_model_parity import RunnerHarness

PARENTS = np.array([-1, 0, 0, 1, 1, 2, 3, 5, 0])  # a bushy tree: depths 0..4, siblings at several levels


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    model_dir, _ = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    return RunnerHarness(model_dir, context_length=128, max_total_tokens=512)


def batch(seqs, backend: str, pages_per_seq: int, tree_bits=None):
    """A ForwardBatch at page size 1 of sequences given as (tokens, positions, first_kv, base): sequence s's KV
    index k lives in slot (and page) base + k, and its tokens are KV indices first_kv ... first_kv + len - 1."""
    i32 = lambda x: jnp.asarray(np.asarray(x, np.int32))  # noqa: E731
    lens = [len(t) for t, _, _, _ in seqs]
    cu = np.concatenate([[0], np.cumsum(lens)])
    return ForwardBatch(
        input_ids=i32(np.concatenate([t for t, _, _, _ in seqs])),
        positions=i32(np.concatenate([p for _, p, _, _ in seqs])),
        out_cache_loc=i32(np.concatenate([b + f + np.arange(len(t)) for t, _, f, b in seqs])),
        cu_q_lens=i32(cu), kv_lens=i32([f + len(t) for t, _, f, _ in seqs]),
        page_indices=i32([b + np.arange(pages_per_seq) for _, _, _, b in seqs]),
        num_seqs=i32([len(seqs)]), logits_indices=i32(cu[1:] - 1), prefix_lens=i32(np.zeros(len(seqs))),
        segment_starts=i32(np.zeros(cu[-1])), shared_prefix_len=i32([0]),
        tree_bits=None if tree_bits is None else i32(tree_bits),
        forward_mode=ForwardMode.EXTEND, attention_backend=backend)


def run(harness, fb, kv):
    """(logits float32[T, V] of every token, the KV caches after the step)."""
    return _run(harness.runner.graphdef, harness.runner.params, fb, kv)


@jax.jit
def _run_jit(graphdef, params, fb, kv):
    model = nnx.merge(graphdef, params)
    hidden, kv = model(fb, kv)
    return model.compute_logits(hidden), kv


def _run(graphdef, params, fb, kv):
    logits, kv = _run_jit(graphdef, params, fb, kv)
    return np.asarray(logits), kv


@pytest.mark.parametrize("backend", ["native", "pallas"])
def test_tree_verify_logits_equal_each_paths_own_forward(harness, backend):
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 49152, 21).tolist()
    tree = rng.integers(0, 49152, len(PARENTS)).tolist()
    depth = tree_depths(PARENTS)
    pages = 32  # per sequence: 9 reference sequences fit the 512-token pool
    fresh = lambda: jax.tree.map(jnp.zeros_like, harness.runner.kv_caches)  # noqa: E731
    L, n = len(prompt), len(PARENTS)
    _, kv = run(harness, batch([(prompt, np.arange(L), 0, 1)], backend, pages), fresh())
    got, _ = run(harness, batch([(tree, L + depth, L, 1)], backend, pages, tree_bits_of(PARENTS)), kv)
    # the reference: each slot's root path after the prompt as a sequence of its own, all in one ordinary step
    refs = []
    for i in range(n):
        path, j = [], i
        while j >= 0:
            path.insert(0, tree[j])
            j = PARENTS[j]
        seq = prompt + path
        refs.append((seq, np.arange(len(seq)), 0, 1 + i * pages))
    want, _ = run(harness, batch(refs, backend, pages), fresh())
    ends = np.cumsum([len(r[0]) for r in refs]) - 1
    np.testing.assert_allclose(got, want[ends], atol=2e-4, rtol=2e-4)
    # the slots off the first chain under the plain causal mask (every earlier slot visible): other logits
    causal, _ = run(harness, batch([(tree, L + depth, L, 1)], backend, pages, np.full(n, NO_TREE)), kv)
    off_chain = [i for i in range(n) if i > 0 and PARENTS[i] != i - 1]
    assert not np.allclose(causal[off_chain], got[off_chain], atol=1e-3), "the tree mask must matter"
