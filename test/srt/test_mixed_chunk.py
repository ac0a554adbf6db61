"""Mixed chunked prefill (--enable-mixed-chunk) and the step budget (--max-prefill-step-ms) on the real SmolLM2
model, checked against transformers (float32).

One Engine with the suite's shapes (so the compile cache serves it), mixing on, and a budget no step can
meet (1 ms): while requests decode, every prefill chunk is cut to the smallest candidate, the 64-token
bucket less the decode rows riding along, so a long prompt is prefilled in many mixed steps.
"""

from __future__ import annotations


import pytest

from srt_helpers import SMALL_ENGINE_ARGS, check_engine_clean, checked_engine, hf_greedy, hf_greedy_penalized

MIXED_ARGS = dict(SMALL_ENGINE_ARGS, log_level="warning", enable_mixed_chunk=True, max_prefill_step_ms=1.0)
SHORT = ["The capital of France is", "def fibonacci(n):\n", "Here is a list of fruits: apple, banana,"]
LONG = ("In the beginning of the computer age, machines filled whole rooms and were programmed by hand. " * 60)
LONG_2 = ("Rivers carry water from the mountains to the sea, shaping valleys over millions of years. " * 60)


def _state(engine) -> dict:
    return engine.get_server_info()["internal_states"][0]


@pytest.fixture(scope="module")
def engine():
    with checked_engine(**MIXED_ARGS) as e:  # (the exact page-ownership check runs after every step)
        # steps for the step-time model to fit (it predicts nothing from fewer than 8)
        e.generate(SHORT[:2], {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
        yield e


def test_flags_reach_the_scheduler(engine):
    state = _state(engine)
    assert state["enable_mixed_chunk"] is True and state["max_prefill_step_ms"] == 1.0
    budget = state["prefill_step_budget"]
    assert budget["budget_ms"] == 1.0 and budget["samples"] >= 8 and len(budget["coefficients"]) == 5


def test_streams_decode_inside_prefill_steps_and_match_transformers(engine, hf_smollm2, smollm2_tokenizer):
    long_ids = smollm2_tokenizer.encode(LONG)
    assert 800 < len(long_ids) < 1500
    before = _state(engine)
    prompts = [smollm2_tokenizer.encode(p) for p in SHORT] + [long_ids]
    outs = engine.generate(input_ids=prompts, sampling_params=[
        {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}] * 3 + [
        {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}])
    after = _state(engine)
    # the long prompt was prefilled in chunks of at most 61 tokens (64 less 3 decode rows) while the short
    # ones decoded in the same steps: ~(1000 - 253) / 61 steps at least
    mixed_steps = after["num_mixed_steps"] - before["num_mixed_steps"]
    assert mixed_steps >= (len(long_ids) - 256) // 61
    assert after["prefill_step_budget"]["last_chunk_limit"] == 61
    assert after["prefill_step_budget"]["num_limited"] > before["prefill_step_budget"]["num_limited"]
    for ids, out, n in zip(prompts, outs, (40, 40, 40, 8)):
        assert out["output_ids"] == hf_greedy(hf_smollm2, ids, n), smollm2_tokenizer.decode(ids[:20])
    check_engine_clean(engine)


def test_penalties_and_logprobs_of_mixed_decode_rows(engine, hf_smollm2, smollm2_tokenizer):
    """A decode row of a mixed step feeds its input token to the penalty counts like a decode step: the
    penalized greedy output over 40 tokens, most of them sampled in mixed steps, alone and beside a long prefill,
    equals transformers' greedy decoding with transformers' RepetitionPenaltyLogitsProcessor(1.2) over prompt +
    output and OpenAI's frequency (1.0) / presence (0.5) formula over the output (srt_helpers.hf_greedy_penalized),
    which differs from the unpenalized greedy output; the reported logprobs alone and mixed agree within 1e-3."""
    ids = smollm2_tokenizer.encode(SHORT[2])
    pen = {"frequency": 1.0, "presence": 0.5, "repetition": 1.2}
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True, "frequency_penalty": 1.0,
              "presence_penalty": 0.5, "repetition_penalty": 1.2}
    alone = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True)
    before = _state(engine)["num_mixed_steps"]
    long_ids = smollm2_tokenizer.encode(LONG_2)  # (not in the radix cache: prefilled in ~15 mixed steps)
    outs = engine.generate(input_ids=[ids, long_ids], sampling_params=[
        params, {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}], return_logprob=True)
    assert _state(engine)["num_mixed_steps"] - before >= 10
    ref = hf_greedy_penalized(hf_smollm2, ids, 40, **pen)
    assert ref != hf_greedy(hf_smollm2, ids, 40)  # the penalties change the output
    assert alone["output_ids"] == ref and outs[0]["output_ids"] == ref
    a = [lp for lp, _, _ in alone["meta_info"]["output_token_logprobs"]]
    m = [lp for lp, _, _ in outs[0]["meta_info"]["output_token_logprobs"]]
    assert max(abs(x - y) for x, y in zip(a, m)) < 1e-3
    check_engine_clean(engine)
