"""Planted faults against one rank's KVMemory (no model): the exact check (`KVMemory.check_invariants`, what
SGL_JAX_CHECK_KV_INVARIANTS runs after every step) and the idle check (`KVMemory.idle_problems`) report each fault
the server's test hooks can plant (fault_injection.PlantedFaults), each by its own message and nothing else: a
leaked page, a twice-freed page (the two together cancel out in the count-based accounting: kv_tokens_in_use stays
0), and a prefix node locked twice -- while its request still runs, and when idle with a streaming session holding
KV (which the idle check's count of locked tokens cannot tell from the session's own lock)."""

import types

import pytest

from sgl_jax.srt import fault_injection
from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.srt.mem_cache.kv_memory import KVCacheSpec, KVMemory
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.scheduler.admission import PrefillAdder
from sgl_jax.srt.scheduler.schedule_batch import FinishReason, Req, ScheduleBatch

PS = 4
WINDOW = 8
PROMPT = list(range(100, 130))
LEAKED, TWICE, LOCKS = "pages owned by nobody (leaked)", "pages owned twice", "prefix locks no holder accounts for"


def new_memory(monkeypatch, kind: str = "radix", **env) -> KVMemory:
    """A rank's KVMemory of cache kind `kind` (built by KVMemory.create from a spec and the cache flags), with the
    planted faults `env` (fault_injection's names -> values) on."""
    for name, value in env.items():
        monkeypatch.setenv(getattr(fault_injection, name), value)
    hybrid = kind == "swa_radix"
    spec = KVCacheSpec(PS, (64 * PS, 32 * PS) if hybrid else (64 * PS,), (0, 1) if hybrid else (0,),
                       WINDOW if hybrid else None)
    flags = types.SimpleNamespace(disable_radix_cache=False, radix_eviction_policy="lfu" if kind == "lfu_radix" else "lru")
    memory = KVMemory.create(spec, num_request_slots=4, context_len=128, server_args=flags, swa_release=True)
    assert memory.cache_kind == kind
    return memory


def admit(memory: KVMemory, ids, rid: str, session=None) -> Req:
    """Admit and prefill one request through the rank's KV memory, as the scheduler does (K/V written)."""
    req = Req(rid, ids, SamplingParams(max_new_tokens=4), eos_token_ids=[], seed=0)
    req.session_kv = session
    adder = PrefillAdder(ShapeBuckets((64,), (1, 4)), memory, [], max_prefill_tokens=64, chunk_size=None,
                         free_req_slots=memory.free_req_slots(), new_token_ratio=1.0)
    assert adder.add(req)
    ScheduleBatch([req], ForwardMode.EXTEND).prepare_for_extend(memory)
    req.kv_committed_len = req.kv_allocated_len
    req.output_ids.append(7)
    return req


def finish(memory: KVMemory, req: Req) -> None:
    req.finished_reason = FinishReason("length", length=1)
    memory.release(req)


def run_one(memory: KVMemory, ids, rid: str) -> None:
    """One request from admission to a normal finish; the exact check holds while it runs."""
    req = admit(memory, ids, rid)
    assert memory.check_invariants([req]) == []
    finish(memory, req)


def only(problems, *messages) -> bool:
    """Whether `problems` report each of `messages` and none of the other planted faults' messages."""
    named = [m for m in (LEAKED, TWICE, LOCKS) if any(m in p for p in problems)]
    return sorted(named) == sorted(messages)


@pytest.mark.parametrize("kind", ["radix", "lfu_radix", "swa_radix"])
def test_without_faults_everything_is_exact(monkeypatch, kind):
    memory = new_memory(monkeypatch, kind)
    run_one(memory, PROMPT, "a")
    run_one(memory, PROMPT, "b")
    assert memory.check_invariants([]) == [] and memory.idle_problems([]) == []


def test_leaked_pages_are_reported(monkeypatch):
    memory = new_memory(monkeypatch, LEAK_PAGES_ENV="3")
    run_one(memory, PROMPT, "a")
    assert only(memory.check_invariants([]), LEAKED), memory.check_invariants([])
    problems = memory.idle_problems([])
    assert only(problems, LEAKED), problems
    assert any(f"{3 * PS} KV tokens in use with nothing running" in p for p in problems), problems
    assert memory.accounting()["kv_tokens_in_use"] == 3 * PS


def test_a_page_freed_twice_is_reported(monkeypatch):
    memory = new_memory(monkeypatch, DOUBLE_FREE_ENV="1")
    run_one(memory, PROMPT, "a")
    assert only(memory.check_invariants([]), TWICE), memory.check_invariants([])
    assert only(memory.idle_problems([]), TWICE), memory.idle_problems([])


def test_a_leak_and_a_double_free_cancel_in_the_counts_but_not_in_the_idle_check(monkeypatch):
    memory = new_memory(monkeypatch, LEAK_PAGES_ENV="1", DOUBLE_FREE_ENV="1")
    run_one(memory, PROMPT, "a")
    acc = memory.accounting()
    assert acc["kv_tokens_in_use"] == 0 and acc["kv_tokens_free"] + acc["kv_tokens_cached"] == acc["kv_tokens_total"]
    assert only(memory.idle_problems([]), LEAKED, TWICE), memory.idle_problems([])


@pytest.mark.parametrize("kind", ["radix", "lfu_radix", "swa_radix"])
def test_a_node_locked_twice_is_reported_by_the_exact_check_while_its_request_runs(monkeypatch, kind):
    memory = new_memory(monkeypatch, kind, DOUBLE_LOCK_ENV="1")
    run_one(memory, PROMPT, "a")  # caches the prompt (its first match is empty: nothing to lock yet)
    assert memory.check_invariants([]) == []
    b = admit(memory, PROMPT, "b")  # matches the cached prefix: locked twice
    problems = memory.check_invariants([b])
    assert only(problems, LOCKS) and "lock_ref 2 != 1 holders" in problems[0], problems
    if kind == "swa_radix":  # the SWA window's lock too
        assert "swa_lock_ref 2 != 1 holders" in problems[0], problems
    finish(memory, b)  # unlocked once: the planted lock stays
    problems = memory.check_invariants([])
    assert only(problems, LOCKS) and "lock_ref 1 != 0 holders" in problems[0], problems
    assert memory.accounting()["kv_tokens_protected"] > 0
    assert only(memory.idle_problems([]), LOCKS), memory.idle_problems([])


def test_a_node_locked_twice_is_reported_when_idle_while_a_session_holds_kv(monkeypatch):
    """A streaming session between turns holds a legitimate lock, so cached tokens are locked with nothing running
    either way: only counting the locks per holder tells the planted one apart."""
    memory = new_memory(monkeypatch, DOUBLE_LOCK_ENV="1")
    run_one(memory, PROMPT, "a")
    session = memory.new_session_kv()
    turn = admit(memory, PROMPT + [5, 6], "turn-1", session)  # matches a's prefix: locked twice
    finish(memory, turn)  # the turn becomes the session's holder, keeping one lock
    assert session.has_kv() and memory.accounting([session])["kv_tokens_protected"] > 0
    problems = memory.idle_problems([session])
    assert only(problems, LOCKS) and "lock_ref 2 != 1 holders" in problems[0], problems
    memory.release_session(session)
    assert only(memory.idle_problems([]), LOCKS), memory.idle_problems([])


def test_a_session_holding_kv_without_faults_is_exact_when_idle(monkeypatch):
    memory = new_memory(monkeypatch)
    run_one(memory, PROMPT, "a")
    session = memory.new_session_kv()
    finish(memory, admit(memory, PROMPT + [5, 6], "turn-1", session))
    assert memory.idle_problems([session]) == []
    assert any(LOCKS in p for p in memory.idle_problems([])), "the session's lock must be accounted for"
    memory.release_session(session)
    assert memory.idle_problems([]) == []


@pytest.mark.parametrize("value", ["", "0"])
def test_faults_are_off_unless_asked_for(monkeypatch, value):
    memory = new_memory(monkeypatch, LEAK_PAGES_ENV=value)
    run_one(memory, PROMPT, "a")
    assert memory.idle_problems([]) == []
