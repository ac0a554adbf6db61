"""--max-prefill-step-ms: the step-time model and the chunk it allows (pure numpy, no model)."""

import numpy as np
from hypothesis import given, settings, strategies as st

from sgl_jax.srt.scheduler.step_budget import (
    PrefillStepBudget,
    RowWork,
    StepTimeModel,
    nonnegative_lstsq,
    step_features,
)
from sgl_jax.srt.model_executor.buckets import ShapeBuckets

BUCKETS = ShapeBuckets((64, 128, 256, 512, 1024, 2048), (1, 8, 32, 64))
# a machine where a step costs 10 ms + 2 ms per padded token + 0.5 ms per 1k KV tokens a decode row reads
TRUE_COEF = np.array([10.0, 2000.0, 5.0, 5.0, 0.0])


def _cost(x):
    return float(TRUE_COEF @ x)


def _fitted_model(rng, n=64, noise=0.0):
    model = StepTimeModel(min_samples=8)
    for _ in range(n):
        kind = rng.integers(3)
        if kind == 0:  # decode step
            k = int(rng.integers(1, 64))
            rows = [RowWork(True, 1, int(rng.integers(10, 2000))) for _ in range(k)]
            x = step_features(BUCKETS.decode_shape(k)[0], True, rows)
        else:  # prefill, sometimes mixed
            c = int(rng.integers(16, 2000))
            rows = [RowWork(False, c, int(rng.integers(0, 1000)))]
            if kind == 2:
                rows += [RowWork(True, 1, int(rng.integers(10, 2000))) for _ in range(int(rng.integers(1, 16)))]
            t = sum(r.q_len for r in rows)
            x = step_features(BUCKETS.extend_shape(t, len(rows))[0], False, rows)
        model.observe(x, _cost(x) * (1 + noise * rng.standard_normal()))
    return model


def test_nonnegative_lstsq_recovers_costs_and_drops_negative_features():
    rng = np.random.default_rng(0)
    X = np.column_stack([np.ones(50), rng.uniform(0, 2, 50), rng.uniform(0, 1, 50), np.zeros(50)])
    y = X @ np.array([3.0, 7.0, 0.5, 0.0])
    np.testing.assert_allclose(nonnegative_lstsq(X, y), [3.0, 7.0, 0.5, 0.0], atol=1e-4)
    # a feature the data say costs negative time is dropped, not used to cancel the others
    y2 = X @ np.array([3.0, 7.0, -2.0, 0.0])
    coef = nonnegative_lstsq(X, y2)
    assert (coef >= 0).all() and coef[2] == 0


def test_model_needs_samples_and_ignores_bad_times():
    model = StepTimeModel(min_samples=3)
    x = step_features(64, False, [RowWork(False, 64, 0)])
    model.observe(x, float("nan"))
    model.observe(x, -1.0)
    assert model.predict(x) is None and len(model.samples) == 0
    for ms in (100.0, 100.0, 100.0):
        model.observe(x, ms)
    assert abs(model.predict(x) - 100.0) < 1e-3


def test_chunk_limit_is_the_largest_bucket_within_the_budget():
    model = _fitted_model(np.random.default_rng(1))
    np.testing.assert_allclose(model.coefficients(), TRUE_COEF, rtol=1e-3, atol=1e-3)
    budget = PrefillStepBudget(600.0, BUCKETS, page_size=16, model=model)
    running = [1500] * 8
    # unmixed: the prefill step's own time (10 + 2 ms per padded token) is the delay
    limit = budget.chunk_limit(2048, 0, running, mixed=False)
    assert limit == 256 and 10 + 2 * 256 <= 600 < 10 + 2 * 512
    assert budget.last_limit == 256 and budget.num_limited == 0  # a decision; steps are counted when formed
    budget.record_step(limit, 2048)
    budget.record_step(None, 2048)  # no limit (nothing running)
    budget.record_step(2048, 2048)  # the limit was the chunk size
    assert budget.num_limited == 1
    # mixed: the step of T_pad = the bucket holding chunk + 8 decode rows, less the same step without the
    # chunk (the 64-token bucket): 2 * (256 - 64) = 384 ms; the 512 bucket would add 896
    limit = budget.chunk_limit(2048, 0, running, mixed=True)
    assert limit == 240  # 256 - 8 rows, cut to whole pages of 16
    assert abs(budget.predicted_delay_ms(limit, 0, running, True) - 2 * (256 - 64)) < 1
    # nothing running, or the chunk size already within the budget: the chunk size
    assert budget.chunk_limit(2048, 0, [], mixed=True) == 2048 and budget.last_limit is None
    roomy = PrefillStepBudget(1e6, BUCKETS, 16, model)
    assert roomy.chunk_limit(2048, 0, running, False) == 2048
    assert roomy.chunk_limit(2048, 0, running, True) == 2032  # the largest bucket holds 8 decode rows too
    # an unreachable budget still lets the smallest chunk through (prefill always progresses)
    tiny = PrefillStepBudget(1.0, BUCKETS, 16, model)
    assert tiny.chunk_limit(2048, 0, running, True) == 48  # the 64-token bucket minus 8 rows, whole pages
    # too few samples: no limit
    assert PrefillStepBudget(1.0, BUCKETS, 16, StepTimeModel()).chunk_limit(2048, 0, running, True) == 2048


@settings(max_examples=60, deadline=None)
@given(budget_ms=st.floats(1, 5000), n_running=st.integers(1, 60), ctx=st.integers(1, 2000),
       prefix=st.integers(0, 4000), chunk=st.sampled_from([64, 256, 1000, 2048]), mixed=st.booleans(),
       seed=st.integers(0, 3))
def test_chosen_chunk_is_within_budget_or_smallest(budget_ms, n_running, ctx, prefix, chunk, mixed, seed):
    model = _fitted_model(np.random.default_rng(seed), noise=0.05)
    budget = PrefillStepBudget(budget_ms, BUCKETS, 16, model)
    running = [ctx] * n_running
    limit = budget.chunk_limit(chunk, prefix, running, mixed)
    cands = budget.candidates(chunk, n_running if mixed else 0)
    assert limit in cands and limit <= chunk and limit % 16 == 0
    if limit != cands[0]:
        assert budget.predicted_delay_ms(limit, prefix, running, mixed) <= budget_ms
    bigger = [c for c in cands if c > limit]
    if bigger:  # the next candidate would not fit the budget (or no bucket holds it)
        try:
            assert budget.predicted_delay_ms(bigger[0], prefix, running, mixed) > budget_ms
        except ValueError:
            pass


def test_decode_step_features_are_the_per_row_features():
    """step_cost_features' decode-step shortcut (no per-row objects) gives what its rows' features give: one-token
    rows that read their committed KV plus the new token."""
    from sgl_jax.srt.forward_batch import ForwardMode
    from sgl_jax.srt.sampling.sampling_params import SamplingParams
    from sgl_jax.srt.scheduler.schedule_batch import Req, ScheduleBatch
    from sgl_jax.srt.scheduler.step_budget import step_cost_features

    rng = np.random.default_rng(0)
    reqs = []
    for i in range(5):
        req = Req(f"r{i}", list(range(1, 1 + int(rng.integers(2, 300)))), SamplingParams(max_new_tokens=8),
                  eos_token_ids=[0], seed=i)
        req.kv_committed_len = len(req.origin_input_ids) - 1
        reqs.append(req)
    ranks = [ScheduleBatch(reqs[:3], ForwardMode.DECODE), None, ScheduleBatch(reqs[3:], ForwardMode.DECODE)]
    rows = [RowWork(True, 1, r.kv_committed_len) for r in reqs]
    expected = step_features(BUCKETS.decode_shape(3)[0], True, rows)
    np.testing.assert_array_equal(step_cost_features(ranks, BUCKETS), expected)
