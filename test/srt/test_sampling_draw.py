"""The compiled sampler's draws against the distributions they must follow (no model).

Temperature sampling draws by inverting each row's CDF with one uniform number per row (`layers/sampler.draw`);
greedy picks the first maximum in two levels (`first_argmax`). References: softmax(logits / T) in float64 for
plain temperature sampling, transformers' TopPLogitsWarper for the nucleus, numpy's argmax for greedy. Each
distribution check draws N tokens (one seed each, fixed, so it cannot flake) and compares counts with a
chi-square statistic; the same statistic must reject a wrong reference (the check can fail).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers.generation.logits_process import TopPLogitsWarper

from sgl_jax.srt.layers.sampler import SAMPLE_BLOCK, draw, first_argmax, new_penalty_state, sample
from sgl_jax.srt.sampling.sampling_batch import SamplingBatch
from sgl_jax.srt.sampling.sampling_params import SamplingParams

V = 300  # more than one SAMPLE_BLOCK and not a multiple of it (the padded tail block)
N = 40_000
EOS = 299


def sampled_tokens(logits: np.ndarray, n: int, first_seed: int = 0, **params) -> np.ndarray:
    """n tokens the compiled sampler draws for one row of logits, seeds first_seed .. first_seed + n - 1."""
    sp = [SamplingParams(**params)] * n
    batch = SamplingBatch.build(sp, {"seeds": list(range(first_seed, first_seed + n))}, n,
                                np.full((n, -(-V // 32)), -1, np.int32))
    ids, _, _ = jax.jit(sample)(jnp.asarray(np.tile(logits, (n, 1))), jax.tree.map(jnp.asarray, batch),
                                jnp.asarray([EOS], jnp.int32), new_penalty_state(1, V))
    return np.asarray(ids)


def chi_square_z(counts: np.ndarray, probs: np.ndarray) -> float:
    """(X^2 - df) / sqrt(2 df) of observed counts against expected probabilities, bins with expected < 5 merged
    into one (normal approximation of the chi-square tail: z > 6 is p < 1e-8 for these dfs)."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    x2 = float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep]))
    df = int(keep.sum()) - 1
    return (x2 - df) / np.sqrt(2 * df)


def test_temperature_draws_follow_softmax():
    rng = np.random.default_rng(11)
    logits = rng.normal(0, 2, V).astype(np.float32)
    logits[[3, 150, 257]] = -np.inf  # (never drawn; one in the padded tail block)
    temperature = 0.7
    ids = sampled_tokens(logits, N, temperature=temperature)
    assert not np.isin(ids, [3, 150, 257]).any()
    counts = np.bincount(ids, minlength=V)
    z = logits.astype(np.float64) / temperature
    probs = np.exp(z - z[np.isfinite(z)].max())
    probs /= probs.sum()
    assert chi_square_z(counts, probs) < 6.0
    # the statistic rejects the distribution at temperature 1 (a sampler ignoring the temperature)
    wrong = np.exp(logits.astype(np.float64) - logits[np.isfinite(logits)].max())
    assert chi_square_z(counts, wrong / wrong.sum()) > 6.0


def test_top_p_draws_follow_the_nucleus():
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 1.5, V).astype(np.float32)
    temperature, top_p = 0.9, 0.8
    ids = sampled_tokens(logits, N, temperature=temperature, top_p=top_p)
    torch.set_num_threads(1)
    scores = TopPLogitsWarper(top_p)(None, torch.tensor(logits[None, :] / temperature, dtype=torch.float64))
    probs = torch.softmax(scores, -1).numpy()[0]
    counts = np.bincount(ids, minlength=V)
    assert not counts[probs == 0].any(), "a token outside the nucleus was drawn"
    assert chi_square_z(counts, probs) < 6.0


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    """Alone, in any order, in any padded size, and beside rows that filter (top-p), which send the whole batch
    through the other sampling branch."""
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 1, (6, V)).astype(np.float32)
    sp = [SamplingParams(temperature=t) for t in (1.0, 0.5, 0.0, 1.3, 0.8, 1.0)]
    seeds = [7, 8, 9, 10, 11, 12]

    def run(order, s_pad):
        batch = SamplingBatch.build([sp[i] for i in order], {"seeds": [seeds[i] for i in order]}, s_pad,
                                    np.full((s_pad, -(-V // 32)), -1, np.int32))
        rows = np.zeros((s_pad, V), np.float32)
        rows[:len(order)] = logits[order]
        ids, _, _ = jax.jit(sample)(jnp.asarray(rows), jax.tree.map(jnp.asarray, batch),
                                    jnp.asarray([EOS], jnp.int32), new_penalty_state(1, V))
        return dict(zip(order, np.asarray(ids)[:len(order)].tolist()))

    together = run(list(range(6)), 8)
    for i in range(6):
        assert run([i], 1)[i] == together[i], f"row {i} drew another token alone"
    assert run([5, 3, 1], 16) == {k: together[k] for k in (5, 3, 1)}
    # beside a top-p row the batch samples through the filtering branch; the unfiltered rows draw the same tokens
    sp.append(SamplingParams(temperature=0.9, top_p=0.5))
    seeds.append(13)
    logits = np.concatenate([logits, rng.normal(0, 1, (1, V)).astype(np.float32)])
    with_top_p = run([6, 0, 1, 2, 3, 4, 5], 8)
    assert {k: with_top_p[k] for k in range(6)} == together
    assert run([6], 1)[6] == with_top_p[6]


def test_draw_never_returns_a_zero_probability_token_at_the_edges():
    """u at 0, just below 1 and at 1 (where float32 rounding can put the target: the cumulative mass inside the
    block may end below the block sums' total), rows whose only finite entries sit at a block's start or end."""
    logits = np.full((4, V), -np.inf, np.float32)
    logits[0, 0] = 0.0
    logits[1, V - 1] = 0.0
    logits[2, [SAMPLE_BLOCK - 1, SAMPLE_BLOCK]] = 0.0
    logits[3, [10, 20]] = [0.0, -30.0]  # (a tiny but nonzero mass)
    for u in (0.0, 0.5, np.nextafter(np.float32(1), np.float32(0)), 1.0):
        got = np.asarray(draw(jnp.asarray(logits), jnp.full((4,), u, jnp.float32)))
        assert got[0] == 0 and got[1] == V - 1
        assert got[2] in (SAMPLE_BLOCK - 1, SAMPLE_BLOCK)
        assert got[3] in (10, 20)


def test_infinite_logits_draw_only_infinite_entries():
    """A near-zero repetition penalty turns logits into +inf (the openapi fuzzer found a grammar request at a
    1e38 temperature drawing a disallowed token from the NaN masses): only +inf entries may be drawn."""
    logits = np.full((3, V), -np.inf, np.float32)
    logits[0, [7, 260]] = np.inf
    logits[0, [8, 9]] = 1.0
    logits[1, 290] = np.inf
    logits[2, :] = 0.0
    logits[2, 100] = np.inf
    for u in (0.0, 0.3, 0.7, np.nextafter(np.float32(1), np.float32(0))):
        for t in (1.0, 1.8e38):
            got = np.asarray(draw(jnp.asarray(logits), jnp.full((3,), u, jnp.float32), jnp.full((3,), t, jnp.float32)))
            assert got[0] in (7, 260) and got[1] == 290 and got[2] == 100, (u, t, got)


def test_first_argmax_matches_numpy_with_ties_across_blocks():
    rng = np.random.default_rng(9)
    x = rng.normal(0, 1, (6, V)).astype(np.float32)
    x[0, [5, 260]] = 9.0  # tie in two blocks: the first wins
    x[1, [270, 280]] = 9.0  # tie inside the padded tail block
    x[2, :] = -np.inf
    x[2, 299] = 1.0
    x[3, :] = 4.0  # all equal
    x[4, 255:257] = 9.0  # tie across a block boundary
    np.testing.assert_array_equal(np.asarray(jax.jit(first_argmax)(jnp.asarray(x))), np.argmax(x, axis=-1))
