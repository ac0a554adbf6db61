"""Restarting with the same flags loads every compiled program from the persistent compilation cache.

Two real Engine starts (scheduler + detokenizer processes) on a tiny random Llama, each in a fresh Python
process, sharing one compilation-cache directory (JAX's cache and the step programs' serialized executables). The
KV pool is auto-sized (no --max-total-tokens) and the free memory it follows moves between the starts by the amount
issue #17 saw on this machine (a pool of 103,192 tokens the first time, 102,011 the second): the test hook
SGL_JAX_TEST_AVAILABLE_MEMORY_BYTES stands in for MemAvailable so the move is exact. The second start must compile
nothing, load every program from the cache (as serialized executables, untraced, each loaded ahead of warm-up from
the list the first start left), serve without compiling, and generate the same tokens. A third start from a copy of
the model directory in another place does the same.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from sgl_jax.srt.model_executor.memory_budget import TEST_AVAILABLE_MEMORY_ENV, stable_pool_tokens
from srt_helpers import save_tiny_llama, server_env

HERE = os.path.dirname(os.path.abspath(__file__))
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny Llama: K and V, 2 layers, 2 KV heads of 16, float32
CPU_MEM_FRACTION = 0.2  # compute_max_total_tokens' CPU default

# The child's Engine is checked as every test engine is (srt_helpers.checked_engine: idle = free + cached, no memory
# error, no compile after warm-up, both child processes gone); it prints its RESULT only once that has passed.
CHILD = r"""
import json, sys
from srt_helpers import checked_engine
args = json.loads(sys.argv[1])
with checked_engine(**args) as engine:
    out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    state = engine.get_server_info()["internal_states"][0]
print("RESULT " + json.dumps({"ids": out["output_ids"], "max_total_tokens": state["max_total_tokens"],
                              "warmup": state["warmup"], "after": state["num_compiles_after_warmup"]}))
"""


def _start(model_dir, tok_dir, cache_dir, pool_tokens: int) -> dict:
    args = dict(model_path=model_dir, tokenizer_path=tok_dir, compilation_cache_dir=str(cache_dir),
                precompile_token_paddings=[64, 128], max_running_requests=4, chunked_prefill_size=128,
                context_length=512, grammar_backend="none", log_level="warning")
    memory = int(pool_tokens * KV_BYTES_PER_TOKEN / CPU_MEM_FRACTION) + 1
    env = server_env({TEST_AVAILABLE_MEMORY_ENV: str(memory), "JAX_PLATFORMS": "cpu",  # srt_helpers importable:
                      "PYTHONPATH": os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH")) if p)})
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], env=env, capture_output=True, text=True,
                          timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[len("RESULT "):])


def test_restarts_with_moved_free_memory_load_everything_from_cache(tmp_path):
    model_dir, tok_dir = save_tiny_llama(tmp_path / "model")
    cache = tmp_path / "jax_cache"
    first = _start(model_dir, tok_dir, cache, 103_192)
    second = _start(model_dir, tok_dir, cache, 102_011)
    assert first["max_total_tokens"] == second["max_total_tokens"] == 98_304, (first, second)
    assert first["warmup"]["compiled"] > 0  # a fresh cache directory
    w = second["warmup"]
    assert w["programs"] >= 6 and w["compiled"] == 0 and w["loaded_from_cache"] == w["programs"], w
    # every program's serialized executable loaded without tracing (program_cache.py)
    assert first["warmup"]["executables_loaded"] == 0 and w["executables_loaded"] == w["programs"], w
    assert w["trace_seconds"] == 0, w
    # ... each loaded ahead, while the weights loaded: the first start noted their keys (program_cache.start_prefetch)
    assert first["warmup"]["executables_loaded_ahead"] == 0 and w["executables_loaded_ahead"] == w["programs"], w
    assert first["after"] == second["after"] == 0  # nothing compiled while serving
    assert second["ids"] == first["ids"] and len(first["ids"]) == 8

    # a copy of the model directory elsewhere (program_cache names a model directory by its contents less the
    # weights, not by its path), and free memory moved below the rounding boundary (97,000 tokens rounds down to
    # 90,112): the pool the last start chose is kept (within 1/16 of the budget: memory_budget.keeps_previous), so
    # nothing compiles and every executable is loaded ahead
    copy_dir = shutil.copytree(model_dir, tmp_path / "elsewhere" / "model")
    third = _start(str(copy_dir), tok_dir, cache, 97_000)
    w3 = third["warmup"]
    assert third["max_total_tokens"] == 98_304 and w3["compiled"] == 0, (third["max_total_tokens"], w3)
    assert w3["executables_loaded_ahead"] == w3["programs"] and third["ids"] == first["ids"], w3


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_stable_pool_tokens(page_size):
    assert stable_pool_tokens(103_192, page_size) == stable_pool_tokens(102_011, page_size) == 98_304
    for tokens in list(range(page_size, 5000, 7)) + [2**20 - 1, 2**20, 10**7 + 3]:
        got = stable_pool_tokens(tokens, page_size)
        assert got % page_size == 0 and got <= tokens, (tokens, got)
        if tokens >= 16 * page_size:
            assert got >= tokens * 8 / 9 - page_size, (tokens, got)  # loses at most a ninth
    # every value maps to one of few sizes: 8 per power of two
    assert len({stable_pool_tokens(t, 1) for t in range(2**16, 2**17)}) == 8


def test_device_kv_budget_counts_the_weights_once():
    """--mem-fraction-static is the share of a TPU/GPU's memory for weights + KV (SGLang's meaning): on a device
    whose allocator limit is 60 GB, with 16 GB of weights loaded (in use), 0.8 leaves 48 - 16 = 32 GB of KV. The
    old formula, 0.8 x (60 - 16) - 16 = 19.2 GB, counted the weights twice."""
    from sgl_jax.srt.model_executor.memory_budget import device_kv_budget_bytes

    GB = 10**9
    assert device_kv_budget_bytes(60 * GB, 16 * GB, 16 * GB, 0.8) == 32 * GB
    assert device_kv_budget_bytes(60 * GB, 17 * GB, 16 * GB, 0.8) == 31 * GB  # other buffers in use count too
    assert device_kv_budget_bytes(60 * GB, 0, 16 * GB, 0.8) == 32 * GB  # an allocator reporting nothing in use


def test_compute_max_total_tokens_on_a_device_uses_the_allocator_figures(monkeypatch):
    """The TPU/GPU path of compute_max_total_tokens: the allocator's (limit, in use) go through
    device_kv_budget_bytes (JAX's own figures replaced by fixed numbers: this machine has no accelerator)."""
    from types import SimpleNamespace

    from sgl_jax.srt.model_executor import memory_budget
    from sgl_jax.srt.server_args import ServerArgs

    monkeypatch.delenv(memory_budget.TEST_AVAILABLE_MEMORY_ENV, raising=False)
    monkeypatch.setattr(memory_budget, "_device_memory_bytes", lambda: (60 * 2**30, 16 * 2**30))
    monkeypatch.setattr(memory_budget, "kv_bytes_per_token", lambda *a, **k: 2**20)  # 1 MiB per token
    mc = SimpleNamespace()
    tokens = memory_budget.compute_max_total_tokens(ServerArgs(), mc, 16 * 2**30, "gpu")
    budget = int(0.8 * 60 * 1024) - 16 * 1024  # MiB: 0.8 of the limit, less what is in use = 32,768 tokens
    assert tokens == stable_pool_tokens(budget, 1) == 32768


def test_the_kv_budget_before_the_weights_load(monkeypatch):
    """compute_max_total_tokens with weight_bytes None (ModelRunner asks before loading the weights, to zero the
    KV pool while they load): on CPU and with --max-total-tokens the budget does not subtract the weights and is
    given; on TPU/GPU it is what they leave, and the caller is told to ask again once they are loaded."""
    from types import SimpleNamespace

    from sgl_jax.srt.model_executor import memory_budget
    from sgl_jax.srt.server_args import ServerArgs

    monkeypatch.setenv(memory_budget.TEST_AVAILABLE_MEMORY_ENV, str(10 * 2**30))
    monkeypatch.setattr(memory_budget, "kv_bytes_per_token", lambda *a, **k: 2**20)
    mc = SimpleNamespace()
    cpu = memory_budget.compute_max_total_tokens(ServerArgs(), mc, None, "cpu")
    assert cpu == memory_budget.compute_max_total_tokens(ServerArgs(), mc, 5 * 2**30, "cpu") == stable_pool_tokens(
        int(0.2 * 10 * 1024), 1)
    assert memory_budget.compute_max_total_tokens(ServerArgs(max_total_tokens=4096), mc, None, "gpu") == 4096
    with pytest.raises(memory_budget.NeedsWeightBytes):
        memory_budget.compute_max_total_tokens(ServerArgs(), mc, None, "gpu")


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_the_last_starts_pool_is_kept_while_the_budget_stays_near_it(monkeypatch, platform):
    """compute_max_total_tokens(previous=...): the pool the last start chose is kept while the budget is within
    1/16 of it (on TPU/GPU only when it still fits); further off, the budget's own rounding decides."""
    from types import SimpleNamespace

    from sgl_jax.srt.model_executor import memory_budget
    from sgl_jax.srt.server_args import ServerArgs

    monkeypatch.setattr(memory_budget, "kv_bytes_per_token", lambda *a, **k: 2**20)  # 1 MiB per token

    def pool(budget_tokens, previous):
        monkeypatch.setenv(memory_budget.TEST_AVAILABLE_MEMORY_ENV, str(budget_tokens * 2**20 * 5))  # 0.2 of it
        frac = None if platform == "cpu" else 0.2
        return memory_budget.compute_max_total_tokens(ServerArgs(mem_fraction_static=frac), SimpleNamespace(), 0,
                                                      platform, previous=previous)

    assert pool(97_000, None) == 90_112  # (the rounding alone)
    assert pool(97_000, 98_304) == (98_304 if platform == "cpu" else 90_112)  # above the budget: CPU only
    assert pool(101_000, 98_304) == 98_304  # within 1/16 and fitting: kept everywhere
    assert pool(110_000, 98_304) == 106_496  # more than 1/16 off: the budget's rounding
    assert not memory_budget.keeps_previous(98_305, 101_000, 16, "cpu")  # not whole pages: not kept
