"""The offline Engine on the real SmolLM2 model: generation checked against transformers (float32)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from sgl_jax.srt.io_struct import OpenSessionReqInput
from sgl_jax.srt.tokenizer.tokenizer_manager import RequestError
from srt_helpers import alive_after, edit_checkpoint, engine_children, hf_greedy, save_tiny_llama, start_engine

GREEDY_32 = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Here is a list of fruits: apple, banana,",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "In 1969, the first humans to walk on the Moon were",
]

OTHER_PROMPTS = [
    "Water boils at",
    "My favourite programming language is",
    "<|im_start|>user\nTell me a joke.<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
    "1, 1, 2, 3, 5, 8,",
    "Photosynthesis is the process",
    "Dear diary, today",
]


@pytest.fixture(scope="module")
def engine(shared_engine):
    """conftest.shared_engine (the suite's configuration plus scoring flags, which do not change generation;
    shared with test_score.py). Leaving its context manager must stop both of its child processes: checked
    when the session ends, without a second Engine start."""
    return shared_engine


def test_greedy_matches_transformers(engine, hf_smollm2, smollm2_tokenizer):
    outs = engine.generate(PROMPTS, GREEDY_32)
    assert len(outs) == len(PROMPTS)  # (zip alone would pass on an empty answer)
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_greedy(hf_smollm2, smollm2_tokenizer.encode(prompt), 32)
        assert out["output_ids"] == ref, f"{prompt!r}: ours {out['text']!r} vs ref {smollm2_tokenizer.decode(ref)!r}"
        assert out["meta_info"]["completion_tokens"] == 32
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 32}


def test_batch_invariance(engine):
    alone = engine.generate(PROMPTS[0], GREEDY_32)
    batch = engine.generate([PROMPTS[0]] + OTHER_PROMPTS, GREEDY_32)
    assert len(batch) == 8
    assert batch[0]["output_ids"] == alone["output_ids"]
    # and the other way round: a batch member alone
    assert engine.generate(OTHER_PROMPTS[3], GREEDY_32)["output_ids"] == batch[4]["output_ids"]


def test_logprobs_match_transformers(engine, hf_smollm2, smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("The quick brown fox jumps over the lazy")
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, "temperature": 0},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=3,
                          token_ids_logprob=[264, 1345], return_text_in_logprobs=True)
    meta = out["meta_info"]
    full = ids + out["output_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf_smollm2(torch.tensor([full])).logits[0], -1).numpy()
    inp = meta["input_token_logprobs"]
    assert len(inp) == len(ids) and inp[0][0] is None and inp[0][1] == ids[0]
    for p in range(1, len(ids)):
        assert inp[p][1] == ids[p] and abs(inp[p][0] - ref[p - 1, ids[p]]) < 1e-3
        assert inp[p][2] == smollm2_tokenizer.decode([ids[p]])
    outp = meta["output_token_logprobs"]
    assert [e[1] for e in outp] == out["output_ids"]
    for j, (lp, tok, _) in enumerate(outp):
        row = ref[len(ids) - 1 + j]
        assert abs(lp - row[tok]) < 1e-3
        top = meta["output_top_logprobs"][j]
        assert [t[1] for t in top] == list(np.argsort(-row)[:3]) and top[0][1] == tok  # greedy = top-1
        assert [t[1] for t in meta["output_token_ids_logprobs"][j]] == [264, 1345]
        assert abs(meta["output_token_ids_logprobs"][j][1][0] - row[1345]) < 1e-3
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 3


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    sp = {"max_new_tokens": 16, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "sampling_seed": 1234}
    a = engine.generate(PROMPTS[2], sp)
    b = engine.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], [sp, GREEDY_32, GREEDY_32])[0]
    assert a["output_ids"] == b["output_ids"]
    seeds = engine.generate([PROMPTS[2]] * 4, [{**sp, "sampling_seed": s} for s in range(4)])
    others = {tuple(o["output_ids"]) for o in seeds}
    assert len(others) > 1, "different seeds should give different samples"


def test_top_k_top_p_min_p_only_sample_allowed_tokens(engine):
    """Every sampled token must satisfy the filter, judged from the returned (temperature 1) logprobs. The
    nine requests (three filters x three seeds) run batched, each row with its own filter (8 + 1: a batch of
    9 would pad to the 32-row bucket and cost as much as nine requests one by one)."""
    filters = [{"temperature": 1.5, "top_k": 3}, {"temperature": 1.0, "top_p": 0.6},
               {"temperature": 1.0, "min_p": 0.2}]
    sps = [{"max_new_tokens": 24, "ignore_eos": True, "sampling_seed": seed, **f} for seed in range(3) for f in filters]
    outs = [out for i in range(0, len(sps), 8)
            for out in engine.generate([PROMPTS[2]] * len(sps[i:i + 8]), sps[i:i + 8], return_logprob=True,
                                       top_logprobs_num=20)]
    assert len(outs) == len(sps)
    for sp, out in zip(sps, outs):
        meta = out["meta_info"]
        steps = list(zip(meta["output_token_logprobs"], meta["output_top_logprobs"]))
        assert len(steps) == 24
        for (lp, tok, _), top in steps:
            if "top_k" in sp:
                assert tok in [t[1] for t in top[:3]]
            elif "top_p" in sp:
                ids = [t[1] for t in top]
                probs = np.exp([t[0] for t in top])
                if tok in ids:
                    assert probs[:ids.index(tok)].sum() < 0.6 + 1e-4, "token outside the nucleus"
                else:
                    assert probs.sum() < 0.6, "token outside the nucleus"
            else:
                assert np.exp(lp) >= 0.2 * np.exp(top[0][0]) - 1e-6


def test_min_p_and_top_k_one_are_greedy_like(engine):
    greedy = engine.generate(PROMPTS[0], {"max_new_tokens": 8, "temperature": 0})
    top1 = engine.generate(PROMPTS[0], {"max_new_tokens": 8, "temperature": 1.5, "top_k": 1})
    minp = engine.generate(PROMPTS[0], {"max_new_tokens": 8, "temperature": 1.0, "min_p": 1.0})
    assert top1["output_ids"] == greedy["output_ids"] == minp["output_ids"]


def test_stop_conditions(engine, smollm2_tokenizer):
    base = engine.generate("1, 2, 3, 4, 5,", {"max_new_tokens": 16, "temperature": 0})
    assert base["text"].startswith(" 6, 7, 8")
    out = engine.generate("1, 2, 3, 4, 5,", {"max_new_tokens": 16, "temperature": 0, "stop": [" 8"]})
    assert out["text"] == " 6, 7," and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 8"}
    seven = smollm2_tokenizer.encode("7")[0]  # digits are single tokens: " 7" is " " + "7"
    out = engine.generate("1, 2, 3, 4, 5,", {"max_new_tokens": 16, "temperature": 0, "stop_token_ids": [seven]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": seven}
    assert out["output_ids"][-1] == seven and out["text"] == " 6, "
    # EOS ends a chat answer unless ignore_eos
    chat = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    out = engine.generate(chat, {"max_new_tokens": 64, "temperature": 0})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert "<|im_end|>" not in out["text"]
    out = engine.generate(chat, {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 40
    # min_new_tokens masks EOS
    out = engine.generate(chat, {"max_new_tokens": 30, "min_new_tokens": 30, "temperature": 0})
    assert out["meta_info"]["completion_tokens"] == 30 and 2 not in out["output_ids"]
    # max_new_tokens 0 only prefills
    out = engine.generate(chat, {"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"


def test_streaming_pieces_add_up(engine):
    prompt = "<|im_start|>user\nWrite one sentence in French with accents and an emoji.<|im_end|>\n" \
             "<|im_start|>assistant\n"
    final = engine.generate(prompt, {"max_new_tokens": 40, "temperature": 0})
    chunks = list(engine.generate(prompt, {"max_new_tokens": 40, "temperature": 0}, stream=True))
    assert len(chunks) > 5 and chunks[-1]["text"] == final["text"]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))  # cumulative


def test_async_generate_and_stream(engine):
    async def main():
        one = await engine.async_generate(PROMPTS[0], {"max_new_tokens": 4, "temperature": 0})
        many = await asyncio.gather(*(engine.async_generate(p, {"max_new_tokens": 4, "temperature": 0})
                                      for p in PROMPTS))
        pieces = [c async for c in await engine.async_generate(PROMPTS[0], {"max_new_tokens": 4, "temperature": 0},
                                                                 stream=True)]
        return one, many, pieces

    one, many, pieces = asyncio.run(main())
    assert many[0]["output_ids"] == one["output_ids"] and pieces[-1]["output_ids"] == one["output_ids"]


def test_invalid_requests_raise_and_engine_keeps_serving(engine):
    with pytest.raises(RequestError, match="temperature"):
        engine.generate("x", {"temperature": -1})
    with pytest.raises(RequestError, match="context length"):
        engine.generate(input_ids=[5] * 2100, sampling_params={"max_new_tokens": 1})
    with pytest.raises(RequestError, match="sampling_params.max_tokens: Extra inputs are not permitted"):
        engine.generate("x", {"max_tokens": 3})
    assert engine.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2


def test_a_late_answer_never_answers_a_later_call(engine):
    """TokenizerManager.control, the one channel for the scheduler's answers, matches them by request id: the
    answer to a call that timed out (opening session "late") is dropped, and the next call of the same kind gets
    its own (session "next"). (With answers queued by type, the next call took the late one.)"""
    tm = engine.tokenizer_manager
    with pytest.raises(RequestError, match="did not answer in time"):
        engine._run(tm.control(OpenSessionReqInput(session_id="late"), timeout=1e-6))
    try:
        assert engine.open_session(session_id="next") == "next"
    finally:
        for session_id in ("late", "next"):
            engine.close_session(session_id)


def test_kv_cache_is_free_when_idle(engine):
    state = engine.get_server_info()["internal_states"][0]
    assert state["kv_tokens_in_use"] == 0 and state["num_running_reqs"] == 0
    assert state["kv_tokens_free"] + state["kv_tokens_cached"] == state["kv_tokens_total"]
    assert state["memory_errors"] == 0 and state["num_compiles_after_warmup"] == 0


def test_a_scheduler_that_cannot_start_fails_the_engine_with_its_reason(tmp_path):
    """The scheduler's start-up error crosses the start-up pipe (io_struct.SchedulerStartupError) with its
    traceback, and the Engine's processes are gone: a checkpoint missing one tensor fails in the scheduler's
    weight loading, after every launch-time check has passed."""
    model_dir, tokenizer_dir = save_tiny_llama(tmp_path)
    dropped = "model.layers.0.mlp.down_proj.weight"
    edit_checkpoint(model_dir, lambda tensors: {k: v for k, v in tensors.items() if k != dropped})
    before = engine_children()
    with pytest.raises(RuntimeError, match=r"(?s)Scheduler failed to start:.*Checkpoint has no tensors"):
        start_engine(model_path=model_dir, tokenizer_path=tokenizer_dir, max_total_tokens=1024,
                     disable_precompile=True, log_level="warning")
    assert not alive_after(engine_children() - before)
