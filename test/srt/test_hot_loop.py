"""The decode hot loop (issue #69): steps make no implicit host <-> device transfer, and a multi-step decode
(--num-continuous-decode-steps K) gives the tokens of K single steps.

In process, on a tiny random Llama: a ModelRunner with its KV memory runs prefill and decode steps of requests with
greedy, seeded and penalized sampling the way the scheduler runs them (the slot decode of DecodeRows, the overlap
loop, a decode step with a vocabulary mask, fused or split in forward and sampling as the overlap scheduler runs a
grammar step) under ``jax.transfer_guard("disallow")``; the tokens of
K = 1 and K = 4 equal the guard-free K = 1 loop without overlap; a planted implicit transfer (the packed inputs
handed over as a host array) fails under the guard. Steps whose rows filter nothing run the decode program without
the sampler's filters and draw the filtering program's tokens; a min_p 0.99 row among them draws its greedy tokens.

On real servers (tiny Llama, SmolLM2's tokenizer): one with ``--num-continuous-decode-steps 4`` whose every step
runs under the transfer guard (SGL_JAX_TEST_TRANSFER_GUARD) answers a workload of greedy, seeded, penalized,
min_new_tokens, stop-token, stop-string, logprob, JSON-schema and streaming requests exactly as a server with the
defaults and --grammar-overlap on does (ids, finish reasons, logprobs within 1e-4); multi-step decodes ran, /metrics
carries the step histograms, and on the second server a JSON-schema request alone has every decode step but its
first launched ahead (its grammar steps split: scheduler/overlap.py). A decode row whose request slot is outside
the runner's is refused (shown failing without the check).
"""

from __future__ import annotations

import concurrent.futures
import json
import os

import httpx
import numpy as np
import pytest

from sgl_jax.bench_decode_loops import DecodeLoop
from sgl_jax.srt import forward_batch
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.forward_batch import DecodeRows, ForwardMode
from sgl_jax.srt.mem_cache.kv_memory import KVMemory, kv_spec_for
from sgl_jax.srt.model_executor import host_copy, program_cache
from sgl_jax.srt.model_executor.buckets import derive_limits
from sgl_jax.srt.model_executor.model_runner import ModelRunner, setup_jax
from sgl_jax.srt.sampling.sampling_batch import all_allowed_mask
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.scheduler.output import commit_launched_row
from sgl_jax.srt.scheduler.schedule_batch import Req, ScheduleBatch
from sgl_jax.srt.server_args import ServerArgs
from srt_helpers import module_server, save_tiny_llama, wait_pool_idle

KV_TOKENS = 4096
STEPS = 12  # decode tokens per request after the first


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("hot_loop"), init_std=0.2)


@pytest.fixture(scope="module")
def harness(tiny):
    """(runner, buckets, slots) of the tiny Llama: 4 request slots, K = 4 (its K = 1 programs too); its one decode
    bucket, S = 4, has the programs without the sampler's filters too (forward_batch.UNFILTERED_DECODE_ROWS)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(forward_batch, "UNFILTERED_DECODE_ROWS", 4)
        yield from _harness(tiny)


def _harness(tiny):
    model, tok = tiny
    sa = ServerArgs(model_path=model, tokenizer_path=tok, context_length=256, max_total_tokens=KV_TOKENS,
                    precompile_bs_paddings=[4], precompile_token_paddings=[64], chunked_prefill_size=64,
                    num_continuous_decode_steps=4, disable_radix_cache=True, random_seed=0, grammar_overlap="on")
    setup_jax(sa)
    mc = ModelConfig.from_server_args(sa, "cpu")
    slots, buckets, _, _ = derive_limits(sa, mc, "cpu")
    runner = ModelRunner(sa, mc, buckets=buckets, max_context_len=mc.context_len, num_request_slots=slots,
                         kv_spec_fn=lambda _: kv_spec_for(sa, mc, KV_TOKENS))
    runner.warmup()
    assert runner.slot_decode and not program_cache.prefetching()
    yield runner, buckets, slots


def new_reqs() -> list:
    """Three requests: greedy, seeded temperature / top-p, greedy with penalties and a logit bias."""
    params = [SamplingParams(max_new_tokens=STEPS + 1, temperature=0.0),
              SamplingParams(max_new_tokens=STEPS + 1, temperature=0.8, top_p=0.9),
              SamplingParams(max_new_tokens=STEPS + 1, temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3,
                             repetition_penalty=1.1, logit_bias={11: 2.0})]
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5], [100, 200, 300, 400, 500, 600, 700, 800, 900]]
    return [Req(f"r{i}", p, sp, eos_token_ids=[], seed=17 + i) for i, (p, sp) in enumerate(zip(prompts, params))]


def prefill(runner, buckets, memory, reqs) -> None:
    """One extend step of every prompt (the host-built fused program), as the scheduler runs it."""
    for r in reqs:
        r.extend_input_len = len(r.origin_input_ids)
    batch = ScheduleBatch(reqs, ForwardMode.EXTEND)
    batch.prepare_for_extend(memory)
    for r in reqs:  # (penalty rows by the slots just given)
        if r.sampling_params.uses_penalties():
            runner.init_penalty_row(r.req_pool_idx, r.fill_ids, len(r.origin_input_ids), r.sampling_params.logit_bias)
    worker_batch = batch.build_model_worker_batch(buckets, memory)
    launched = batch.launched()
    out = runner.launch_ranks([worker_batch]).resolve()[0]
    for i, r in enumerate(launched.reqs):
        commit_launched_row(launched, i)
        r.output_ids.append(int(out.next_token_ids[i]))


def masked_step(runner, buckets, memory, reqs, split: bool = False, allowed=None) -> None:
    """One decode step the way the scheduler runs a grammar step: with --disable-overlap-schedule the slot decode
    with a vocabulary mask built after the step before was applied; with overlap (`split`) the slot decode
    unmasked, then the sampling of its logits again with the mask (scheduler/step_launch.py). The mask allows every
    token, or only the token ids `allowed` in every row."""
    batch = ScheduleBatch(reqs, ForwardMode.DECODE)
    assert batch.prepare_for_decode(memory)
    worker_batch = batch.build_model_worker_batch(buckets, memory, fill_vocab_mask=False)
    launched = batch.launched()
    mask = all_allowed_mask(worker_batch.rows_pad, runner.vocab_mask_width)
    if allowed is not None:  # (rows marked constrained, as a grammar's are: the step applies their masks)
        worker_batch.sampling.constrained[:len(reqs)] = True
        mask[:] = 0
        for t in allowed:
            mask[:, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    if split:
        out = runner.launch_sample(runner.launch_decode_split([worker_batch]), mask).resolve()[0]
    else:
        out = runner.launch_ranks([worker_batch], mask).resolve()[0]
    for i, r in enumerate(launched.reqs):
        commit_launched_row(launched, i)
        r.output_ids.append(int(out.next_token_ids[i]))


def run(harness, num_steps: int, overlap: bool, guarded: bool, masked_first: bool = False,
        split_first: bool = False, allowed=None, reqs=None) -> list:
    """Every request's output tokens after prefill and STEPS decode tokens (num_steps per launch); the first decode
    step with a vocabulary mask (`masked_first`; `split_first`: as the overlap scheduler splits it) allowing every
    token or only `allowed`. `reqs`: `new_reqs()` unless given."""
    runner, buckets, slots = harness
    memory = KVMemory.create(runner.kv_spec, num_request_slots=slots, context_len=256, disable_radix_cache=True)
    reqs = new_reqs() if reqs is None else reqs
    with host_copy.transfer_guard(guarded):
        prefill(runner, buckets, memory, reqs)
        left = STEPS
        if masked_first or split_first:
            masked_step(runner, buckets, memory, reqs, split_first, allowed)
            left -= 1
        DecodeLoop(runner, memory, buckets, num_steps).run(reqs, left // num_steps, overlap)
    for r in reqs:
        memory.release(r)
    assert memory.free_tokens() == memory.size
    return [r.output_ids for r in reqs]


def test_decode_steps_make_no_implicit_transfer(harness):
    reference = run(harness, 1, overlap=False, guarded=False)
    assert all(len(t) == STEPS + 1 for t in reference)
    assert len(set(reference[1])) > 1  # the seeded row samples
    runner = harness[0]
    assert runner.grammar_split  # (--grammar-overlap on, overlap on, a grammar backend)
    for num_steps, overlap, masked, split in ((1, False, False, False), (1, True, False, False),
                                              (4, True, False, False), (4, False, False, False),
                                              (1, True, True, False), (1, True, False, True)):
        assert run(harness, num_steps, overlap, guarded=True, masked_first=masked,
                   split_first=split) == reference, (num_steps, overlap, masked, split)
    # a mask that binds: the split step samples the masked logits as the slot decode with the mask does
    allowed = (5, 7, 11)
    fused = run(harness, 1, True, guarded=True, masked_first=True, allowed=allowed)
    assert all(t[1] in allowed for t in fused) and fused != reference
    assert run(harness, 1, True, guarded=True, split_first=True, allowed=allowed) == fused
    assert runner.num_compiles_after_warmup == 0


def unfiltered_reqs(top_row: dict) -> list:
    """Greedy, seeded temperature and penalized requests (none filters) and a fourth with `top_row`'s parameters,
    on the second's prompt."""
    params = [SamplingParams(max_new_tokens=STEPS + 1, temperature=0.0),
              SamplingParams(max_new_tokens=STEPS + 1, temperature=0.9),
              SamplingParams(max_new_tokens=STEPS + 1, temperature=0.7, repetition_penalty=1.2),
              SamplingParams(max_new_tokens=STEPS + 1, **top_row)]
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5], [100, 200, 300, 400], [9, 8, 7, 6, 5]]
    return [Req(f"u{i}", p, sp, eos_token_ids=[], seed=23 + i) for i, (p, sp) in enumerate(zip(prompts, params))]


def test_steps_without_filters_run_the_unfiltered_program(harness, monkeypatch):
    """A decode step whose rows filter nothing (greedy, temperature, penalties) runs the program without the
    sampler's top-k / top-p / min-p / typical-p branch (DecodeRows.filtering; issue #69) and draws the tokens the
    filtering program draws (K = 1 and K = 4). A row with min_p 0.99 at temperature 1 keeps only its most likely
    token: its seeded draws are the greedy tokens of its prompt, which only the filtering program gives."""
    runner = harness[0]
    launched = []
    over = DecodeRows._over  # (every DecodeRows a step launches is made here: `build`, `from_rows`)
    monkeypatch.setattr(DecodeRows, "_over", classmethod(lambda cls, *a: launched.append(over(*a)) or launched[-1]))
    lean = {k: run(harness, k, True, guarded=True, reqs=unfiltered_reqs({"temperature": 0.0})) for k in (1, 4)}
    assert launched and not any(r.filtering for r in launched)
    assert lean[1] == lean[4] and len(set(lean[1][1])) > 1  # (the temperature rows sample)
    nucleus = run(harness, 1, True, guarded=True, reqs=unfiltered_reqs({"temperature": 1.0, "min_p": 0.99}))
    assert launched[-1].filtering
    greedy = run(harness, 1, True, guarded=True, reqs=unfiltered_reqs({"temperature": 0.0}))[3]
    assert nucleus[3] == greedy and nucleus[:3] == lean[1][:3]
    monkeypatch.setattr(SamplingParams, "filters", lambda self: True)  # every step on the filtering program
    assert {k: run(harness, k, True, guarded=True, reqs=unfiltered_reqs({"temperature": 0.0})) for k in (1, 4)} == lean
    assert launched[-1].filtering and runner.num_compiles_after_warmup == 0


def test_planted_implicit_transfer_fails_under_the_guard(harness, monkeypatch):
    """The check above is shown failing: a step whose packed inputs reach the program as a host array."""
    monkeypatch.setattr(host_copy, "put", lambda x, sharding: x)
    with pytest.raises(Exception, match="(?i)disallowed host-to-device transfer"):
        run(harness, 1, overlap=False, guarded=True)


# ---------------------------------------------------------------- servers
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "def fibonacci(n):", "List three colors:",
           "Q: What is 7 times 8?\nA:"]


def probe_stops(url: str) -> dict:
    """Stop conditions the model is sure to meet, from greedy probes: a stop token id (the 6th token of prompt 4's
    output), a stop string (a piece of prompt 3's text), and for min_new_tokens a token id it emits early."""
    out = []
    for prompt in (PROMPTS[3], PROMPTS[2], PROMPTS[5]):
        r = httpx.post(url + "/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 16,
                                                                                      "temperature": 0}}, timeout=300)
        assert r.status_code == 200, r.text
        out.append(r.json())
    text = out[1]["text"]
    return {"token": out[0]["output_ids"][5], "string": text[len(text) // 2:len(text) // 2 + 3],
            "early": out[2]["output_ids"][1]}


def workload_params(stops: dict) -> list:
    """Sampling parameters of the batch (see the module docstring)."""
    return [{"max_new_tokens": 17, "temperature": 0},
            {"max_new_tokens": 19, "temperature": 0.8, "top_p": 0.9, "seed": 3},
            {"max_new_tokens": 16, "temperature": 0, "frequency_penalty": 0.5, "presence_penalty": 0.3,
             "repetition_penalty": 1.1, "logit_bias": {"11": 2.0}, "min_new_tokens": 5},
            {"max_new_tokens": 23, "temperature": 0, "stop": [stops["string"]]},
            {"max_new_tokens": 21, "temperature": 0, "stop_token_ids": [stops["token"]]},
            {"max_new_tokens": 13, "temperature": 0, "min_new_tokens": 6, "stop_token_ids": [stops["early"]]}]


def run_workload(url: str, stops: dict) -> dict:
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[4], PROMPTS[2], PROMPTS[3], PROMPTS[5]]
    batch = {"text": prompts, "sampling_params": workload_params(stops), "return_logprob": True}
    top = {"text": "Write a haiku about the sea.", "return_logprob": True, "top_logprobs_num": 3,
           "sampling_params": {"max_new_tokens": 9, "temperature": 0}}
    js = {"text": "Give a person as JSON:", "sampling_params": {"max_new_tokens": 24, "temperature": 0.7, "seed": 5,
                                                                 "json_schema": json.dumps(SCHEMA)}}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(httpx.post, url + "/generate", json=b, timeout=300) for b in (batch, top, js)]
        answers = [f.result() for f in futures]
    for a in answers:
        assert a.status_code == 200, a.text
    body = {"text": "Count to ten:", "stream": True, "sampling_params": {"max_new_tokens": 14, "temperature": 0}}
    streamed = []
    with httpx.stream("POST", url + "/generate", json=body, timeout=300) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                streamed.append(json.loads(line[6:]))
    return {"batch": answers[0].json(), "top": [answers[1].json()], "json": [answers[2].json()],
            "stream": [streamed[-1]]}


@pytest.fixture(scope="module")
def default_tiny_server(tiny):
    """The defaults but --grammar-overlap on (auto is off on a CPU device): its JSON-schema steps are launched
    ahead and drawn again with their masks."""
    model, tok = tiny
    yield from module_server(["--model-path", model, "--tokenizer-path", tok, "--max-running-requests", "8",
                              "--context-length", "256", "--max-total-tokens", "8192", "--grammar-overlap", "on"])


@pytest.fixture(scope="module")
def multi_step_server(tiny):
    model, tok = tiny
    yield from module_server(["--model-path", model, "--tokenizer-path", tok, "--max-running-requests", "8",
                              "--context-length", "256", "--max-total-tokens", "8192",
                              "--num-continuous-decode-steps", "4", "--enable-metrics"],
                             env={"SGL_JAX_TEST_TRANSFER_GUARD": "1"})


def numbers(x) -> list:
    if isinstance(x, (list, tuple)):
        return [v for item in x for v in numbers(item)]
    return [0 if x is None else x]


def test_multi_step_server_under_the_guard_matches_the_default(default_tiny_server, multi_step_server):
    stops = probe_stops(default_tiny_server.url)
    reference = run_workload(default_tiny_server.url, stops)
    multi = run_workload(multi_step_server.url, stops)
    for part in reference:
        for a, b in zip(reference[part], multi[part]):
            assert a["output_ids"] == b["output_ids"], part
            ma, mb = a["meta_info"], b["meta_info"]
            assert ma["finish_reason"] == mb["finish_reason"] and ma["completion_tokens"] == mb["completion_tokens"]
            for key in ("output_token_logprobs", "output_top_logprobs"):
                assert numbers(ma.get(key)) == pytest.approx(numbers(mb.get(key)), abs=1e-4), (part, key)
    finish = [o["meta_info"]["finish_reason"] for o in reference["batch"]]
    assert [f["type"] for f in finish[3:5]] == ["stop", "stop"], finish  # mid K-step block, on the host's checks
    assert finish[4]["matched"] == stops["token"] and finish[3]["matched"] == stops["string"], finish
    assert reference["batch"][5]["meta_info"]["completion_tokens"] >= 6  # (min_new_tokens before a stop token)
    info = httpx.get(multi_step_server.url + "/get_server_info", timeout=30).json()["internal_states"][0]
    assert info["num_multi_step_decodes"] > 0 and info["memory_errors"] == 0
    assert info["num_grammar_split_steps"] == 0  # (--grammar-overlap auto: off on a CPU device)
    state = httpx.get(default_tiny_server.url + "/get_server_info", timeout=30).json()["internal_states"][0]
    assert state["num_multi_step_decodes"] == 0 and state["num_grammar_split_steps"] >= 10, state
    # alone, every decode step of a JSON-schema request but its first (after the prefill, applied at once) is
    # launched before the one before it is applied: its slot decode runs while the masks are filled
    wait_pool_idle(default_tiny_server.url)
    js = {"text": "Give a person as JSON:", "sampling_params": {"max_new_tokens": 24, "temperature": 0.7, "seed": 5,
                                                                 "json_schema": json.dumps(SCHEMA)}}
    r = httpx.post(default_tiny_server.url + "/generate", json=js, timeout=300)
    after = wait_pool_idle(default_tiny_server.url)
    tokens = r.json()["meta_info"]["completion_tokens"]
    ahead = after["num_overlapped_steps"] - state["num_overlapped_steps"]
    split = after["num_grammar_split_steps"] - state["num_grammar_split_steps"]
    assert tokens >= 10 and ahead >= tokens - 2 and split >= tokens - 1, (tokens, ahead, split)
    metrics = httpx.get(multi_step_server.url + "/metrics", timeout=30).text
    for name in ("sglang:scheduler_step_host_seconds", "sglang:scheduler_step_device_wait_seconds",
                 "sglang:scheduler_steps_per_second"):
        assert f'{name}_bucket{{le="+Inf"' in metrics, name
    count = [line for line in metrics.splitlines() if line.startswith("sglang:scheduler_step_host_seconds_count")]
    assert count and float(count[0].split()[-1]) > 10


def test_a_slot_outside_the_runner_is_refused(harness):
    """A request slot past the runner's num_request_slots would have its slot-state and penalty rows dropped on the
    device (decoding against another row's page table): the launch refuses it."""
    runner, buckets, slots = harness
    _, s_pad = buckets.decode_shape(1)
    rows = DecodeRows.build(np.array([slots]), np.array([1]), np.array([3]), np.array([[5]]), np.array([0]),
                            np.array([False]), s_pad)
    with pytest.raises(ValueError, match=f"request slot {slots} outside"):
        runner.launch_decode([rows])


def test_xla_compiler_options_reach_the_step_programs(tiny):
    """--xla-compiler-options is checked when the flags are read (a JSON object of scalars, or a ValueError naming
    the flag) and handed to the step programs' compiles: a value XLA refuses fails the warm-up with XLA's error,
    which names the option (so a valid one, such as the GPU's command-buffer settings, is applied, not dropped)."""
    model, tok = tiny
    for bad in ("[1]", "{\"a\": [1]}", "not json"):
        with pytest.raises(ValueError, match="--xla-compiler-options"):
            ServerArgs(model_path=model, tokenizer_path=tok, xla_compiler_options=bad)
    with pytest.raises(ValueError, match="--grammar-overlap must be one of"):  # (auto, on, off)
        ServerArgs(model_path=model, tokenizer_path=tok, grammar_overlap="maybe")
    sa = ServerArgs(model_path=model, tokenizer_path=tok, context_length=256, max_total_tokens=KV_TOKENS,
                    precompile_bs_paddings=[4], precompile_token_paddings=[64], chunked_prefill_size=64,
                    disable_radix_cache=True, random_seed=0,
                    xla_compiler_options='{"xla_gpu_command_buffer_update_mode": "NOT_A_MODE"}')
    assert sa.xla_options() == {"xla_gpu_command_buffer_update_mode": "NOT_A_MODE"}
    mc = ModelConfig.from_server_args(sa, "cpu")
    slots, buckets, _, _ = derive_limits(sa, mc, "cpu")
    runner = ModelRunner(sa, mc, buckets=buckets, max_context_len=mc.context_len, num_request_slots=slots,
                         kv_spec_fn=lambda _: kv_spec_for(sa, mc, KV_TOKENS))
    with pytest.raises(Exception, match="xla_gpu_command_buffer_update_mode"):
        runner.warmup()
    # the loading ahead a runner began ends with its warm-up, failed or not, and with its build when that fails
    # (left begun, a later runner of the process shared it and noted its keys for another start's flags)
    assert not program_cache.prefetching()

    def refuse(weight_bytes):
        assert program_cache.prefetching()  # (begun before the pool is sized)
        raise ValueError("no room")

    with pytest.raises(ValueError, match="no room"):
        ModelRunner(sa, mc, buckets=buckets, max_context_len=mc.context_len, num_request_slots=slots,
                    kv_spec_fn=refuse)
    assert not program_cache.prefetching()


def test_multi_step_program_gets_the_cpu_xla_options(tiny, monkeypatch):
    """The K-step decode program (--num-continuous-decode-steps K > 1) is compiled with CPU_MULTI_STEP_XLA_OPTIONS
    on a CPU device (under --xla-compiler-options, which win), the one-step programs without them: with a value XLA
    refuses planted in those options, the warm-up of a runner with K = 4 fails with XLA's error naming the option,
    and one with K = 1 compiles."""
    from sgl_jax.srt.model_executor import step_programs

    assert step_programs.multi_step_xla_options({}, "cpu") == step_programs.CPU_MULTI_STEP_XLA_OPTIONS
    assert step_programs.multi_step_xla_options({"xla_cpu_enable_concurrency_optimized_scheduler": True}, "cpu") == {
        "xla_cpu_enable_concurrency_optimized_scheduler": True}
    assert step_programs.multi_step_xla_options({"a": 1}, "gpu") == {"a": 1}
    monkeypatch.setattr(step_programs, "CPU_MULTI_STEP_XLA_OPTIONS",
                        {"xla_cpu_enable_concurrency_optimized_scheduler": "not-a-bool"})
    model, tok = tiny
    for k in (1, 4):
        sa = ServerArgs(model_path=model, tokenizer_path=tok, context_length=256, max_total_tokens=KV_TOKENS,
                        precompile_bs_paddings=[4], precompile_token_paddings=[64], chunked_prefill_size=64,
                        disable_radix_cache=True, random_seed=0, num_continuous_decode_steps=k)
        mc = ModelConfig.from_server_args(sa, "cpu")
        slots, buckets, _, _ = derive_limits(sa, mc, "cpu")
        runner = ModelRunner(sa, mc, buckets=buckets, max_context_len=mc.context_len, num_request_slots=slots,
                             kv_spec_fn=lambda _: kv_spec_for(sa, mc, KV_TOKENS))
        if k == 1:
            runner.warmup()
        else:
            with pytest.raises(Exception, match="xla_cpu_enable_concurrency_optimized_scheduler"):
                runner.warmup()


def thread_policies(pid: int) -> dict:
    """{thread name: set of scheduling policies (sched(7) numbers, /proc stat field 41)} of process `pid`."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                policy = int(f.read().rsplit(")", 1)[1].split()[38])
        except FileNotFoundError:
            continue
        out.setdefault(name, set()).add(policy)
    return out


def test_other_threads_yield_to_the_launcher_on_cpu_with_one_step_decode():
    """`cpu_threads.yield_to_launcher` gives every other thread of the process SCHED_BATCH on a CPU device with
    --num-continuous-decode-steps 1 (the calling thread keeps SCHED_OTHER), and nothing on another platform or with
    K > 1. Real threads, real policies (os.sched_getscheduler)."""
    import threading

    from sgl_jax.srt.model_executor.cpu_threads import other_thread_ids, yield_to_launcher

    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, daemon=True)
    worker.start()
    tid = worker.native_id
    others = [t for t in other_thread_ids() if os.sched_getscheduler(t) == os.SCHED_OTHER]  # (put back after)
    try:
        assert tid in others
        assert yield_to_launcher("gpu", 1) == 0 and yield_to_launcher("cpu", 4) == 0
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER
        assert yield_to_launcher("cpu", 1) >= 1
        assert os.sched_getscheduler(tid) == os.SCHED_BATCH and os.sched_getscheduler(0) == os.SCHED_OTHER
    finally:
        for t in others:
            try:
                os.sched_setscheduler(t, os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass
        stop.set()
        worker.join()


def test_the_servers_xla_threads_yield_with_one_step_decode(default_tiny_server, multi_step_server):
    """The scheduler process calls it after its warm-up: XLA's Eigen threads are SCHED_BATCH in the default server
    (K = 1) and keep SCHED_OTHER in the K = 4 server; the log says so in one line."""
    def eigen_policies(server) -> set:
        found = [thread_policies(pid) for pid in server.children]
        return set().union(*(p.get("tf_XLAEigen", set()) for p in found))

    assert eigen_policies(default_tiny_server) == {os.SCHED_BATCH}
    assert eigen_policies(multi_step_server) == {os.SCHED_OTHER}
    assert "set to SCHED_BATCH" in default_tiny_server.log_text()
    assert "set to SCHED_BATCH" not in multi_step_server.log_text()


def test_the_benchmarks_stream_client_reads_batched_events(default_tiny_server):
    """bench_hot_loop's streaming client (the response's bytes split into events, each parsed by orjson) on a real
    batch stream, whose events the server writes several to a chunk: it counts every prompt's tokens (its check
    fails when an event of a chunk is lost)."""
    from sgl_jax.bench_hot_loop import generate_batch

    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    generate_batch(default_tiny_server.url, prompts, 6, stream=True)
    generate_batch(default_tiny_server.url, prompts, 6, stream=False)


def test_the_benchmarks_instances_combine_by_median():
    """bench_hot_loop --instances: each bench time and each server step is the median over the instances (a None
    overlap time anywhere stays None), every instance's x bench is listed, and instances of different batch sizes
    are refused; a one-instance result renders as before (no instance lines)."""
    from sgl_jax.bench_hot_loop import combine_instances, format_table

    def inst(overlap, plain, stream, device=0.1):
        row = {"batch_size": 1, "decode_overlap_median_ms": overlap, "decode_median_ms": 0.3,
               "decode_device_ms": device}
        return {"bench_rows": [row], "server": [{"batch_size": 1, "plain": {"median_ms": plain},
                                                 "stream": {"median_ms": stream}}],
                "step_stats": {}, "compiles_after_warmup": 0}

    instances = [inst(0.2, 0.4, 0.8), inst(0.1, 0.2, 0.3), inst(0.16, 0.9, 0.5, device=0.5)]
    got = combine_instances(instances)
    row, srv = got["bench_rows"][0], got["server"][0]
    assert (row["decode_overlap_median_ms"], row["decode_device_ms"]) == (0.16, 0.1)
    assert (srv["plain"]["median_ms"], srv["stream"]["median_ms"]) == (0.4, 0.5)
    assert srv["plain"]["instance_medians_ms"] == [0.4, 0.2, 0.9]
    assert combine_instances([inst(None, 0.4, 0.8), inst(0.1, 0.2, 0.3)])["bench_rows"][0][
        "decode_overlap_median_ms"] is None
    other = inst(0.1, 0.2, 0.3)
    other["server"][0]["batch_size"] = 16
    with pytest.raises(ValueError, match="different batch sizes"):
        combine_instances([inst(0.1, 0.2, 0.3), other])

    hist = {"buckets": [0.001], "counts": [1]}
    base = {"model": "m", "input_len": 192, "server_flags": [], "cpu": "c", "server_tokens": [32, 160],
            "bench_input_len": 224, "bench_output_len": 128, "compiles_after_warmup": 0,
            "step_stats": {k: hist for k in ("host_seconds", "device_wait_seconds", "steps_per_second")}}
    table = format_table({**base, **got, "instances": instances})
    assert "| 1 | 0.160 | 0.300 | 0.100 | 0.400 | 2.50 | 0.500 | 3.12 |" in table
    assert "- B = 1: 2.00 / 4.00, 2.00 / 3.00, 5.62 / 3.12" in table and "median over 3 instances" in table
    single = format_table({**base, **{k: instances[0][k] for k in ("bench_rows", "server")}})
    assert "instances" not in single and "| 1 | 0.200 | 0.300 | 0.100 | 0.400 | 2.00 | 0.800 | 4.00 |" in single
