"""Multi-LoRA serving (srt/lora/, layers/lora.py, scheduler/lora_control.py) against transformers + peft float32.

A tiny random Llama (SmolLM2's vocabulary) with five PEFT adapters: ranks 4, 8 and 16, different target sets,
one with rsLoRA; a tiny Qwen3 (q/k norms) with one. One server (4 slots, rank 16) serves them:
- each adapter alone: greedy tokens identical to PEFT over 8 prompts x 32 tokens, logprobs within 1e-3;
- one concurrent batch of 4 adapters and the base: each request exactly what it gets alone;
- an adapter loaded while requests run, used (equal to PEFT), another unloaded, the busy one refused with 409,
  slots reused least recently used; no compile after warm-up through all of it, the idle check after;
- the radix cache never serves one adapter's prefix to another (nor the base's);
- /v1/score with an adapter equals PEFT; the OpenAI client's ``model: "<base>:<adapter>"`` and ``"<adapter>"``;
  /v1/models lists the adapters; unknown adapters and unfit ones get 400 naming them;
- tp 2 (virtual CPU devices) serves the mixed batch token-identically to tp 1.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import httpx
import numpy as np
import pytest
import torch

from srt_helpers import ServerProcess, check_clean, wait_pool_idle

torch.set_num_threads(1)

STEPS = 32
LONG = 1500  # tokens of the requests that run while adapters are loaded, used and unloaded
LOGPROB_TOL = 1e-3
# name -> (rank, targets, rsLoRA); r16_mlp also has PEFT's rank_pattern and alpha_pattern (PATTERNS)
ADAPTERS = {
    "r4_qv": (4, ["q_proj", "v_proj"], False),
    "r8_all_rs": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "r16_mlp": (16, ["o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "r16_attn": (16, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    "late_r8": (8, ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"], False),  # loaded at run time
}
STARTUP = ["r4_qv", "r8_all_rs", "r16_mlp", "r16_attn"]
PATTERNS = {"r16_mlp": dict(rank_pattern={"down_proj": 8}, alpha_pattern={"o_proj": 4})}


@pytest.mark.parametrize("backend", ["dense", "ragged"])
def test_lora_delta_backends_equal_the_per_token_product(backend):
    """layers/lora.lora_delta: each token gets B[s] (A[s] x) of its own slot s, none for slot -1."""
    from sgl_jax.srt.layers.lora import lora_delta

    rng = np.random.default_rng(0)
    n, r, k, m, t = 3, 4, 24, 40, 37
    a, b = rng.standard_normal((n, r, k)), rng.standard_normal((n, r, m))
    x, ids = rng.standard_normal((t, k)), rng.integers(-1, n, size=t)
    want = np.stack([np.zeros(m) if s < 0 else (a[s] @ x[i]) @ b[s] for i, s in enumerate(ids)])
    got = lora_delta(*(np.float32(v) for v in (x, a, b)), np.int32(ids), backend)
    assert np.allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


def save_adapter(model_dir: str, out_dir: str, rank: int, targets, rslora: bool, seed: int, dtype=torch.float32,
                 **patterns) -> str:
    """A PEFT LoRA adapter of `model_dir` with random A and B (std 0.1: a clear effect on the output), saved in
    `dtype`; `patterns`: LoraConfig's rank_pattern / alpha_pattern."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), use_rslora=rslora,
                     init_lora_weights=False, **patterns)
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    model = model.to(dtype)
    model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(model_dir: str, adapter_dir, prompts, steps: int = STEPS):
    """(tokens, logprobs) per prompt: transformers (+ the PEFT adapter) greedy, float32."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids, toks, lps = list(p), [], []
            res = model(torch.tensor([ids]), use_cache=True)
            for _ in range(steps):
                logp = torch.log_softmax(res.logits[0, -1].double(), -1)
                t = int(logp.argmax())
                toks.append(t)
                lps.append(float(logp[t]))
                res = model(torch.tensor([[t]]), past_key_values=res.past_key_values, use_cache=True)
            out.append((toks, lps))
    return out


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    """(model dir, tokenizer dir, {adapter name: dir}, prompts) of the tiny Llama and its adapters."""
    from srt_helpers import save_tiny_llama

    root = tmp_path_factory.mktemp("lora")
    model_dir, tok = save_tiny_llama(root / "llama", num_layers=2, init_std=0.2)
    dirs = {name: save_adapter(model_dir, str(root / name), r, t, rs, seed=i, **PATTERNS.get(name, {}))
            for i, (name, (r, t, rs)) in enumerate(ADAPTERS.items())}
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(2, 49152, size=int(n)).tolist() for n in rng.integers(5, 40, size=8)]
    return model_dir, tok, dirs, prompts


@pytest.fixture(scope="module")
def references(lora_models):
    model_dir, _, dirs, prompts = lora_models
    return {name: peft_greedy(model_dir, None if name is None else dirs[name], prompts)
            for name in [None] + list(ADAPTERS)}


def lora_server_args(lora_models, tp: int = 1, extra=()) -> list:
    model_dir, tok, dirs, _ = lora_models
    return [*extra, "--model-path", model_dir, "--tokenizer-path", tok, "--served-model-name", "tiny",
            "--lora-paths", *[f"{n}={dirs[n]}" for n in STARTUP], "--max-loras-per-batch", "4",
            "--max-lora-rank", "16", "--lora-target-modules", "all", "--max-loaded-loras", "5",
            "--tp-size", str(tp), "--log-level", "info"]


@pytest.fixture(scope="module")
def server(lora_models):
    s = ServerProcess(lora_server_args(lora_models))
    yield s
    s.stop_checked()


def generate(url: str, prompt, lora, steps: int = STEPS) -> dict:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": steps, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "lora_path": lora}
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def tokens_and_logprobs(out: dict):
    lps = out["meta_info"]["output_token_logprobs"]
    return [t for _, t, *_ in lps], [lp for lp, *_ in lps]


def assert_matches(out: dict, ref, what: str) -> None:
    toks, lps = tokens_and_logprobs(out)
    assert toks == ref[0], what
    assert np.max(np.abs(np.array(lps) - np.array(ref[1]))) < LOGPROB_TOL, what


def test_each_adapter_matches_peft_and_a_mixed_batch_matches_alone(server, lora_models, references):
    _, _, _, prompts = lora_models
    alone = {}
    for name in [None] + STARTUP:
        for i, p in enumerate(prompts):
            alone[name, i] = generate(server.url, p, name)
            assert_matches(alone[name, i], references[name][i], f"adapter {name}, prompt {i}")
    # the base and four adapters in one concurrent batch: each gets exactly what it got alone
    jobs = [(name, i) for i in range(len(prompts)) for name in [None] + STARTUP]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        mixed = list(pool.map(lambda j: generate(server.url, prompts[j[1]], j[0]), jobs))
    for job, out in zip(jobs, mixed):
        toks, lps = tokens_and_logprobs(out)
        ref_toks, ref_lps = tokens_and_logprobs(alone[job])
        assert toks == ref_toks, job
        assert np.max(np.abs(np.array(lps) - np.array(ref_lps))) < 1e-4, job
    # a native batch with one adapter per prompt
    r = httpx.post(server.url + "/generate", timeout=300, json={
        "input_ids": prompts[:2], "lora_path": ["r4_qv", None],
        "sampling_params": {"max_new_tokens": STEPS, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == [references["r4_qv"][0][0], references[None][1][0]]
    wait_pool_idle(server.url)


def test_radix_cache_keeps_adapters_apart(server):
    prompt = np.random.default_rng(7).integers(2, 49152, size=40).tolist()  # (shares no token with other tests)
    base = generate(server.url, prompt, None, steps=4)
    first = generate(server.url, prompt, "r4_qv", steps=4)
    assert first["meta_info"]["cached_tokens"] == 0, "the base model's prefix served an adapter's request"
    other = generate(server.url, prompt, "r16_mlp", steps=4)
    assert other["meta_info"]["cached_tokens"] == 0, "one adapter's prefix served another's request"
    again = generate(server.url, prompt, "r4_qv", steps=4)
    assert again["meta_info"]["cached_tokens"] >= len(prompt) - 1, "an adapter's own prefix was not reused"
    assert again["output_ids"] == first["output_ids"] != base["output_ids"]


def test_session_turns_with_an_adapter(server, lora_models):
    """A classic session's second turn under an adapter equals the adapter on the whole conversation at once."""
    _, _, _, prompts = lora_models
    url = server.url
    sid = httpx.post(url + "/open_session", json={"capacity_of_str_len": 1000}).json()
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    first = httpx.post(url + "/generate", json={"input_ids": prompts[1], "sampling_params": sp, "lora_path": "r16_mlp",
                                                "session_params": {"id": sid}}).json()
    rid = first["meta_info"]["id"]
    second = httpx.post(url + "/generate", json={"input_ids": prompts[2][1:], "sampling_params": sp,
                                                 "lora_path": "r16_mlp", "session_params": {"id": sid, "rid": rid}})
    assert second.status_code == 200, second.text
    whole = generate(url, prompts[1] + first["output_ids"] + prompts[2][1:], "r16_mlp", 8)
    assert second.json()["output_ids"] == whole["output_ids"]
    assert httpx.post(url + "/close_session", json={"session_id": sid}).status_code == 200


def test_load_use_unload_under_load_without_compiles(server, lora_models, references):
    _, _, dirs, prompts = lora_models
    url = server.url
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = [pool.submit(generate, url, prompts[i], "r8_all_rs", LONG) for i in range(3)]
        while httpx.get(url + "/get_server_info").json()["internal_states"][0]["num_running_reqs"] < 3:
            time.sleep(0.05)
        for name in ("r4_qv", "r16_mlp", "r16_attn"):  # r8_all_rs's slot becomes the least recently used one
            generate(url, prompts[0], name, 2)
        r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "late_r8", "lora_path": dirs["late_r8"]})
        assert r.status_code == 200 and r.json()["success"], r.text
        assert set(r.json()["loaded_adapters"]) == set(STARTUP) | {"late_r8"}
        # the new adapter runs at once (its weights go into the least recently used idle slot), equal to PEFT
        assert_matches(generate(url, prompts[2], "late_r8"), references["late_r8"][2], "late_r8")
        slots = httpx.get(url + "/get_server_info").json()["internal_states"][0]["lora_slots"]
        assert len(slots) == 4 and "late_r8" in slots.values() and "r8_all_rs" in slots.values(), slots
        assert not any(f.done() for f in running), "the long requests ended before the slot was reused"
        busy = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "r8_all_rs"})
        assert busy.status_code == 409 and "in use" in busy.json()["error_message"], busy.text
        cached = httpx.get(url + "/get_server_info").json()["internal_states"][0]["kv_tokens_cached"]
        r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "r16_attn"})
        assert r.status_code == 200 and "r16_attn" not in r.json()["loaded_adapters"], r.text
        # its cached prefixes (of the short request above) are freed with it
        after = httpx.get(url + "/get_server_info").json()["internal_states"][0]["kv_tokens_cached"]
        assert after <= cached - len(prompts[0]), (cached, after)
        during = [f.result()["output_ids"] for f in running]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # (their slot was never reused while they ran)
        after = list(pool.map(lambda i: generate(url, prompts[i], "r8_all_rs", LONG)["output_ids"], range(3)))
    assert during == after and during[0][:STEPS] == references["r8_all_rs"][0][0]
    gone = httpx.post(url + "/generate", json={"input_ids": prompts[0], "lora_path": "r16_attn"})
    assert gone.status_code == 400 and "r16_attn" in gone.text
    # reload it, and the adapters keep matching PEFT after their slots were reused
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "r16_attn", "lora_path": dirs["r16_attn"]})
    assert r.status_code == 200, r.text
    for name in ("r16_attn", "r4_qv", "late_r8"):
        assert_matches(generate(url, prompts[5], name), references[name][5], name)
    st = check_clean(url)  # nothing compiled after warm-up, pool back to free + cached, idle check clean
    assert st["lora_slot_writes"] >= 5 and "r16_attn" in st["lora_slots"].values(), st
    r = httpx.post(url + "/unload_lora_adapter", json={"lora_name": "late_r8"})
    assert r.status_code == 200, r.text


def test_openai_models_scores_and_errors(server, lora_models, references):
    import openai
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir, _, dirs, prompts = lora_models
    url = server.url
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    # the slots are counted with the weights (before the KV pool is sized): the model's bytes + 4 slots
    from safetensors.numpy import load_file

    info = httpx.get(url + "/get_server_info").json()["scheduler_info"]
    model_bytes = sum(a.nbytes for a in load_file(os.path.join(model_dir, "model.safetensors")).values())
    assert info["weight_bytes_per_device"] == model_bytes + 4 * info["lora_slot_bytes"] > model_bytes
    listed = {m.id: m for m in client.models.list().data}
    assert listed["tiny"].root == "tiny" and {"r4_qv", "r16_mlp"} <= set(listed)
    assert listed["r4_qv"].parent == "tiny" and listed["r4_qv"].root == dirs["r4_qv"]
    want = generate(url, prompts[3], "r16_mlp", 8)["text"]
    assert want != generate(url, prompts[3], None, 8)["text"]
    for model in ("tiny:r16_mlp", "r16_mlp"):
        out = client.completions.create(model=model, prompt=prompts[3], max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == want, model
    for bad, param in (("tiny:nope", "model"), ):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=bad, prompt="hi", max_tokens=2)
        assert "nope" in str(e.value) and e.value.body.get("param") == param
    r = httpx.post(url + "/generate", json={"text": "hi", "lora_path": "nope"})
    assert r.status_code == 400 and "nope" in r.json()["error"]["message"], r.text
    # an adapter of a larger rank than the slots, and one targeting the LM head, are refused with the reason
    for name, why in (("too_big", "rank 32"), ("lm_head", "lm_head")):
        adir = os.path.join(os.path.dirname(dirs["r4_qv"]), name)
        targets = ["q_proj"] if name == "too_big" else ["q_proj", "lm_head"]
        save_adapter(model_dir, adir, 32 if name == "too_big" else 4, targets, False, seed=9)
        r = httpx.post(url + "/load_lora_adapter", json={"lora_name": name, "lora_path": adir})
        assert r.status_code == 400 and why in r.json()["error_message"], r.text
    # an adapter of another model's shapes is refused at load (not when first used)
    from safetensors.numpy import save_file

    wrong = os.path.join(os.path.dirname(dirs["r4_qv"]), "wrong")
    os.makedirs(wrong, exist_ok=True)
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((4, 32), np.float32),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros((64, 4), np.float32)},
              os.path.join(wrong, "adapter_model.safetensors"))
    with open(os.path.join(wrong, "adapter_config.json"), "w") as f:
        f.write('{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}')
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "wrong", "lora_path": wrong})
    assert r.status_code == 400 and "another base model" in r.json()["error_message"], r.text
    # a bfloat16 adapter loads and serves (its weights widened to float32)
    bf16 = save_adapter(model_dir, os.path.join(os.path.dirname(dirs["r4_qv"]), "bf16"), 4, ["q_proj", "v_proj"],
                        False, seed=0, dtype=torch.bfloat16)
    r = httpx.post(url + "/load_lora_adapter", json={"lora_name": "bf16", "lora_path": bf16})
    assert r.status_code == 200, r.text
    out = generate(url, prompts[0], "bf16", 4)["output_ids"]
    assert out == peft_greedy(model_dir, bf16, prompts[:1], 4)[0][0]  # (PEFT on the same bfloat16 weights)
    assert httpx.post(url + "/unload_lora_adapter", json={"lora_name": "bf16"}).status_code == 200
    # /v1/score with an adapter equals PEFT's next-token probabilities
    query, items, labels = prompts[4], [prompts[6][:5], prompts[7][:9]], [11, 400, 9000]
    r = httpx.post(url + "/v1/score", json={"query": query, "items": items, "label_token_ids": labels,
                                            "lora_path": "r8_all_rs"}, timeout=120)
    assert r.status_code == 200, r.text
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                      dirs["r8_all_rs"]).eval()
    with torch.no_grad():
        for item, got in zip(items, r.json()["scores"]):
            probs = torch.softmax(model(torch.tensor([query + item])).logits[0, -1].double(), -1)
            assert np.allclose(got, probs[labels].numpy(), atol=1e-5, rtol=1e-3), (got, probs[labels])
    base = httpx.post(url + "/v1/score", json={"query": query, "items": items, "label_token_ids": labels})
    assert not np.allclose(base.json()["scores"], r.json()["scores"], atol=1e-4)
    wait_pool_idle(url)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_equals_tp1(lora_models, server, tp):
    """The mixed batch on a tp 2 and a tp 4 server (virtual CPU devices; at tp 4 the 2 KV heads are replicated,
    and so are their B rows): token-identical to tp 1, logprobs within 1e-3."""
    _, _, _, prompts = lora_models
    jobs = [(name, i) for i in range(3) for name in [None, "r4_qv", "r8_all_rs", "r16_mlp"]]
    admin = {"Authorization": "Bearer admin-key"}
    tp2 = ServerProcess(lora_server_args(lora_models, tp=tp, extra=("--admin-api-key", "admin-key")),
                        env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={tp}", "JAX_PLATFORMS": "cpu"})
    try:
        # with --admin-api-key the adapter endpoints need it
        r = httpx.post(tp2.url + "/unload_lora_adapter", json={"lora_name": "r16_attn"})
        assert r.status_code == 401, r.text
        r = httpx.post(tp2.url + "/unload_lora_adapter", json={"lora_name": "r16_attn"}, headers=admin)
        assert r.status_code == 200, r.text
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            two = list(pool.map(lambda j: generate(tp2.url, prompts[j[1]], j[0], 16), jobs))
    finally:
        tp2.stop_checked(admin)
    for job, out in zip(jobs, two):
        one = generate(server.url, prompts[job[1]], job[0], 16)
        toks, lps = tokens_and_logprobs(out)
        ref_toks, ref_lps = tokens_and_logprobs(one)
        assert toks == ref_toks, job
        assert np.max(np.abs(np.array(lps) - np.array(ref_lps))) < LOGPROB_TOL, job


def test_qwen3_adapter_matches_peft(tmp_path, lora_models):
    """Qwen3 (q/k norms) with an all-module rank-8 adapter, served through the offline Engine with the ragged
    update (--lora-backend ragged)."""
    from transformers import Qwen3Config

    from srt_helpers import checked_engine
    from test_tensor_parallel import save_tiny

    _, tok, _, prompts = lora_models
    cfg = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      tie_word_embeddings=True, initializer_range=0.2)
    model_dir = save_tiny(tmp_path / "qwen3", cfg)
    adir = save_adapter(model_dir, str(tmp_path / "q8"), 8, ADAPTERS["r8_all_rs"][1], False, seed=3)
    refs = peft_greedy(model_dir, adir, prompts[:4])
    with checked_engine(model_path=model_dir, tokenizer_path=tok, lora_paths=[f"q8={adir}"], context_length=512,
                        max_total_tokens=4096, precompile_token_paddings=[64], precompile_bs_paddings=[1, 4],
                        chunked_prefill_size=64, max_running_requests=4, random_seed=0, log_level="warning",
                        lora_backend="ragged") as e:
        outs = e.generate(input_ids=prompts[:4], lora_path=["q8"] * 4, return_logprob=True,
                          sampling_params={"max_new_tokens": STEPS, "temperature": 0, "ignore_eos": True})
        for out, ref in zip(outs, refs):
            assert_matches(out, ref, "qwen3 q8")
