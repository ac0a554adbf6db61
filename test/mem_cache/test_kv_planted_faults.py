"""Planted faults against one rank's KVMemory (no model): the exact page-ownership check and the idle check
report each fault the server's test hooks can plant (fault_injection.PlantedFaults), including a leaked page
and a twice-freed page together, which cancel out in the count-based accounting (kv_tokens_in_use stays 0)."""

import pytest

from sgl_jax.srt import fault_injection
from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.kv_memory import KVMemory
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.scheduler.admission import PrefillAdder
from sgl_jax.srt.scheduler.schedule_batch import FinishReason, Req, ScheduleBatch

PS = 4


def run_one(memory: KVMemory, ids, rid: str) -> Req:
    """Admit, prefill and finish one request through the rank's KV memory, as the scheduler does."""
    req = Req(rid, ids, SamplingParams(max_new_tokens=4), eos_token_ids=[], seed=0)
    adder = PrefillAdder(ShapeBuckets((64,), (1, 4)), memory, [], max_prefill_tokens=64, chunk_size=None,
                         free_req_slots=memory.free_req_slots(), new_token_ratio=1.0)
    assert adder.add(req)
    ScheduleBatch([req], ForwardMode.EXTEND).prepare_for_extend(memory)
    req.kv_committed_len = req.kv_allocated_len
    req.output_ids.append(7)
    assert memory.check_invariants([req]) == []
    req.finished_reason = FinishReason("length", length=1)
    memory.release(req)
    return req


def new_memory(monkeypatch, **env) -> KVMemory:
    for name, value in env.items():
        monkeypatch.setenv(getattr(fault_injection, name), value)
    pool = ReqToTokenPool(4, 128)
    alloc = PagedTokenToKVPoolAllocator(64 * PS, PS)
    return KVMemory(pool, alloc, RadixCache(pool, alloc, PS))


PROMPT = list(range(100, 130))


def test_without_faults_everything_is_exact(monkeypatch):
    memory = new_memory(monkeypatch)
    run_one(memory, PROMPT, "a")
    run_one(memory, PROMPT, "b")
    assert memory.idle_problems([]) == []


def test_leaked_pages_are_reported(monkeypatch):
    memory = new_memory(monkeypatch, LEAK_PAGES_ENV="3")
    run_one(memory, PROMPT, "a")
    problems = memory.idle_problems([])
    assert any("pages owned by nobody (leaked)" in p for p in problems), problems
    assert any(f"{3 * PS} KV tokens in use with nothing running" in p for p in problems), problems
    assert memory.accounting()["kv_tokens_in_use"] == 3 * PS


def test_a_page_freed_twice_is_reported(monkeypatch):
    memory = new_memory(monkeypatch, DOUBLE_FREE_ENV="1")
    run_one(memory, PROMPT, "a")
    assert any("pages owned twice" in p for p in memory.check_invariants([])), memory.check_invariants([])


def test_a_leak_and_a_double_free_cancel_in_the_counts_but_not_in_the_idle_check(monkeypatch):
    memory = new_memory(monkeypatch, LEAK_PAGES_ENV="1", DOUBLE_FREE_ENV="1")
    run_one(memory, PROMPT, "a")
    acc = memory.accounting()
    assert acc["kv_tokens_in_use"] == 0 and acc["kv_tokens_free"] + acc["kv_tokens_cached"] == acc["kv_tokens_total"]
    problems = memory.idle_problems([])
    assert any("leaked" in p for p in problems) and any("owned twice" in p for p in problems), problems


def test_a_node_locked_twice_stays_locked_and_is_reported(monkeypatch):
    memory = new_memory(monkeypatch, DOUBLE_LOCK_ENV="1")
    run_one(memory, PROMPT, "a")  # caches the prompt (its first match is empty: nothing to lock yet)
    assert memory.idle_problems([]) == []
    run_one(memory, PROMPT, "b")  # matches the cached prefix: locked twice, unlocked once
    problems = memory.idle_problems([])
    assert memory.accounting()["kv_tokens_protected"] > 0
    assert any("cached tokens still locked with nothing running" in p for p in problems), problems


@pytest.mark.parametrize("value", ["", "0"])
def test_faults_are_off_unless_asked_for(monkeypatch, value):
    memory = new_memory(monkeypatch, LEAK_PAGES_ENV=value)
    run_one(memory, PROMPT, "a")
    assert memory.idle_problems([]) == []
