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

from sgl_jax.srt.layers import sampler
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


def test_candidate_tiers_and_the_threshold_search_keep_the_sorts_tokens(monkeypatch):
    """The filtering branch takes each row's kept set from its top-k candidates (`sampler.CANDIDATE_TIERS`, here
    8 and 32 of 300) when every filtering row's set lies inside them, else from the next tier, else from a search
    for each set's boundary value over whole rows (`_kept_by_threshold`): every way draws the tokens a sort of
    whole rows draws (SORT_FREE False). Batches whose widest row fits 8, needs 32, and needs the whole row (a flat
    top-p 0.99 row; a flat top-k 100 row; a typical-p row, which sorts), beside unfiltered and greedy rows, with
    ties at the boundaries (a row of 12 equal logits under top-p 0.45 and under top-k 5); 64 seeds each. The
    compiled step holds the top-k calls (the tiers are taken, not only written)."""
    rng = np.random.default_rng(3)
    peaked = rng.normal(0, 4, V).astype(np.float32)  # top-p 0.6 keeps a few tokens
    flat = rng.normal(0, 0.3, V).astype(np.float32)  # top-p 0.99 keeps most of the 300
    tied = np.full(V, -30.0, np.float32)
    tied[rng.choice(V, 12, replace=False)] = 2.0  # 12 equal leaders: a boundary inside a tie
    logits = np.stack([peaked, flat, peaked, flat, peaked, flat, tied, tied])
    fits_8 = [dict(temperature=0.9, top_p=0.6), dict(temperature=1.0), dict(temperature=0.0, top_p=0.5),
              dict(temperature=0.7, top_k=5), dict(temperature=1.1, min_p=0.3), dict(temperature=0.8, top_k=8),
              dict(temperature=1.0, top_p=0.45), dict(temperature=1.0, top_k=5)]
    batches = {"fits_8": fits_8, "needs_32": fits_8[:5] + [dict(temperature=0.8, top_k=20, top_p=0.99)] + fits_8[6:],
               "needs_all": fits_8[:5] + [dict(temperature=0.8, top_p=0.99, min_p=0.05)] + fits_8[6:],
               "top_k_all": fits_8[:5] + [dict(temperature=0.8, top_k=100)] + fits_8[6:],
               "typical": fits_8[:5] + [dict(temperature=0.8, typical_p=0.9)] + fits_8[6:]}

    def run(params, seeds):
        n = len(params) * len(seeds)
        sp = [SamplingParams(**p) for _ in seeds for p in params]
        batch = SamplingBatch.build(sp, {"seeds": [s for s in seeds for _ in params]}, n,
                                    np.full((n, -(-V // 32)), -1, np.int32))
        args = (jnp.asarray(np.tile(logits, (len(seeds), 1))), jax.tree.map(jnp.asarray, batch),
                jnp.asarray([EOS], jnp.int32), new_penalty_state(1, V))
        return np.asarray(jax.jit(sample)(*args)[0]), jax.jit(sample).lower(*args).as_text()

    seeds = list(range(64))
    monkeypatch.setattr(sampler, "SORT_FREE", False)
    jax.clear_caches()  # (jit's cache of `sample` does not see the module's constants)
    reference = {name: run(params, seeds)[0] for name, params in batches.items()}
    monkeypatch.setattr(sampler, "SORT_FREE", True)
    for tiers in ((8, 32), ()):
        monkeypatch.setattr(sampler, "CANDIDATE_TIERS", tiers)
        jax.clear_caches()
        for name, params in batches.items():
            ids, hlo = run(params, seeds)
            np.testing.assert_array_equal(ids, reference[name], err_msg=f"{name}, tiers {tiers}")
            assert (hlo.count("top_k") + hlo.count("topk") >= 2) == bool(tiers), name
    assert len(set(reference["needs_all"][5::8].tolist())) > 20  # (the flat row's draws spread over many tokens)
    assert len(set(reference["fits_8"][6::8].tolist())) == 6  # (top-p 0.45 of 12 equal leaders: 6 of them)
    assert len(set(reference["fits_8"][7::8].tolist())) == 5  # (top-k 5 of them: the first 5 by id)


def test_sort_free_filtering_is_faster_than_sorting_whole_rows(monkeypatch):
    """At SmolLM2's vocabulary (49,152), 16 top-p rows at temperature 0.8: the filtering step without a sort
    takes under 1/4 of the whole-row sort's time, both measured here, with logits drawn at standard deviation 6
    (peaked: the 128 candidates hold the set) and 2 (flat: the threshold search); on a 2-core CPU ~11 and ~27 ms
    against ~225 ms."""
    import time

    vocab, rows = 49_152, 16
    batch = jax.tree.map(jnp.asarray, SamplingBatch.build(
        [SamplingParams(temperature=0.8, top_p=0.95)] * rows, {"seeds": list(range(rows))}, rows,
        np.full((rows, -(-vocab // 32)), -1, np.int32)))

    def best_ms(sort_free, logits):
        monkeypatch.setattr(sampler, "SORT_FREE", sort_free)
        jax.clear_caches()
        f = jax.jit(sample)
        args = (logits, batch, jnp.asarray([EOS], jnp.int32), new_penalty_state(1, vocab))
        jax.block_until_ready(f(*args))
        times = []
        for _ in range(3):
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append((time.perf_counter() - t) * 1e3)
        return min(times), np.asarray(f(*args)[0])

    for std in (6.0, 2.0):
        logits = jnp.asarray(np.random.default_rng(0).normal(0, std, (rows, vocab)).astype(np.float32))
        fast_ms, fast_ids = best_ms(True, logits)
        sort_ms, sort_ids = best_ms(False, logits)
        np.testing.assert_array_equal(fast_ids, sort_ids)
        assert fast_ms < sort_ms / 4, (std, fast_ms, sort_ms)
