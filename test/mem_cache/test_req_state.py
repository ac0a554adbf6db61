"""Per-request state beyond KV (mem_cache/req_state.py) through one rank's KVMemory, no model: a request takes a slot
of every state pool with its request slot and gives it back on the one release path (finish, abort, retract); a
streaming session's turns keep theirs; the accounting (``<name>_state_slots_*``) and the exact and idle checks
see it, and report a planted leak, a slot owned twice and a free request slot holding one."""

import random
import types

import numpy as np
import pytest

from sgl_jax.srt import fault_injection
from sgl_jax.srt.configs.model_config import ModelConfig
from sgl_jax.srt.mem_cache.common import release_kv_cache
from sgl_jax.srt.mem_cache.kv_invariants import req_state_problems
from sgl_jax.srt.mem_cache.kv_memory import KVCacheSpec, KVMemory, kv_spec_for
from sgl_jax.srt.mem_cache.req_state import ReqStatePool, ReqStateSpec
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sgl_jax.srt.models.llama import LlamaForCausalLM
from sgl_jax.srt.scheduler.schedule_batch import FinishReason, Req, finish_abort
from test_kv_planted_faults import admit  # (admission and prefill through a rank's KVMemory, as the scheduler)

PS = 4
STATES = (ReqStateSpec("recurrent", 4096), ReqStateSpec("conv", 256))


def new_memory(monkeypatch, **env) -> KVMemory:
    """A rank's KVMemory (radix cache, 4 request slots) whose spec carries STATES, with planted faults `env`."""
    for name, value in env.items():
        monkeypatch.setenv(getattr(fault_injection, name), value)
    spec = KVCacheSpec(PS, (64 * PS,), (0,), req_states=STATES)
    flags = types.SimpleNamespace(disable_radix_cache=False, radix_eviction_policy="lru")
    return KVMemory.create(spec, num_request_slots=4, context_len=128, server_args=flags)


def state_slots(memory: KVMemory, req: Req) -> list:
    return memory.req_to_token_pool.state_slots[:, req.req_pool_idx].tolist()


def in_use(memory: KVMemory) -> dict:
    acc = memory.accounting()
    return {s.name: acc[f"{s.name}_state_slots_in_use"] for s in STATES}


def test_a_request_holds_a_state_slot_from_admission_to_release(monkeypatch):
    memory = new_memory(monkeypatch)
    acc = memory.accounting()
    assert {k: acc[k] for k in acc if k.startswith("recurrent")} == {
        "recurrent_state_slots_total": 4, "recurrent_state_slots_free": 4, "recurrent_state_slots_in_use": 0}
    a, b = admit(memory, list(range(10, 30)), "a"), admit(memory, list(range(40, 60)), "b")
    assert sorted(state_slots(memory, a) + state_slots(memory, b)) == [0, 0, 1, 1]
    assert in_use(memory) == {"recurrent": 2, "conv": 2}
    assert memory.check_invariants([a, b]) == []
    a.finished_reason = FinishReason("length", length=1)
    memory.release(a)  # finished
    b.finished_reason = finish_abort("client went away")
    memory.release(b)  # aborted
    assert in_use(memory) == {"recurrent": 0, "conv": 0} and memory.idle_problems([]) == []
    c = admit(memory, list(range(10, 30)), "c")
    release_kv_cache(c, memory.tree_cache, is_insert=False)  # retracted: computed again on its return
    c.reset_for_retract()
    assert in_use(memory) == {"recurrent": 0, "conv": 0} and memory.idle_problems([]) == []


def test_a_streaming_session_keeps_its_state_between_turns(monkeypatch):
    memory = new_memory(monkeypatch)
    session = memory.new_session_kv()
    t1 = admit(memory, list(range(10, 30)), "t1", session)
    slots = state_slots(memory, t1)
    t1.finished_reason = FinishReason("length", length=1)
    memory.release(t1)
    assert session.has_kv() and in_use(memory) == {"recurrent": 1, "conv": 1}
    assert memory.idle_problems([session]) == []
    t2 = admit(memory, t1.fill_ids + [5, 6], "t2", session)
    assert state_slots(memory, t2) == slots  # the turn goes on from the session's state
    t2.finished_reason = FinishReason("length", length=1)
    memory.release(t2)
    memory.release_session(session)
    assert in_use(memory) == {"recurrent": 0, "conv": 0} and memory.idle_problems([]) == []


def test_request_slots_and_state_slots_run_out_together():
    pools = [ReqStatePool(STATES[0], 3), ReqStatePool(STATES[1], 2)]
    pool = ReqToTokenPool(3, 16, pools)
    assert pool.alloc() is not None and pool.alloc() is not None
    assert pool.alloc() is None  # the conv pool has no slot left: the recurrent slot taken first is given back
    assert pool.available_size() == 1 and [p.available_size() for p in pools] == [1, 0]
    pool.free(2)
    assert pool.state_slots[:, 2].tolist() == [-1, -1] and [p.available_size() for p in pools] == [2, 1]
    with pytest.raises(ValueError, match="slot 2 freed twice"):
        pool.free(2)
    assert [p.available_size() for p in pools] == [2, 1]


def test_random_allocs_and_frees_keep_every_slot_owned_once():
    rng = random.Random(0)
    pool = ReqToTokenPool(6, 8, [ReqStatePool(s, 6) for s in STATES])
    held = []
    for _ in range(500):
        if held and (rng.random() < 0.5 or not pool.available_size()):
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            held.append(pool.alloc())
        assert req_state_problems(pool) == []
        assert all(p.available_size() == pool.available_size() for p in pool.state_pools)
        assert len({tuple(pool.state_slots[:, r]) for r in held}) == len(held)


def test_planted_faults_are_reported(monkeypatch):
    """A slot dropped at the first finished request (LEAK_STATE_ENV) fails the idle check; a held slot also on the
    free list, and a free request slot holding one (its slot is then also owned by nobody), fail the exact check."""
    leaky = new_memory(monkeypatch, LEAK_STATE_ENV="1")
    req = admit(leaky, list(range(10, 30)), "a")
    req.finished_reason = FinishReason("length", length=1)
    leaky.release(req)
    problems = leaky.idle_problems([])
    assert any("recurrent state slots owned by nobody (leaked)" in p for p in problems), problems
    assert not any("twice" in p for p in problems)
    monkeypatch.delenv(fault_injection.LEAK_STATE_ENV)

    twice = new_memory(monkeypatch)
    req = admit(twice, list(range(10, 30)), "a")
    twice.req_to_token_pool.state_pools[1]._free.push_unchecked(np.array(state_slots(twice, req)[1:], np.int32))
    problems = twice.check_invariants([req])
    assert problems == [f"conv state slots owned twice: {state_slots(twice, req)[1:]}"], problems

    stale = new_memory(monkeypatch)
    pool = stale.req_to_token_pool
    free_row = pool._free[0]
    pool.state_slots[0, free_row] = pool.state_pools[0].alloc()
    problems = stale.check_invariants([])
    assert f"recurrent state: free request slots [{free_row}] hold state slots" in problems, problems


def test_the_spec_takes_the_model_configs_states_and_the_decoder_stack_has_none():
    sa = types.SimpleNamespace(disable_hybrid_swa_memory=False, page_size=PS, swa_full_tokens_ratio=0.8)
    mc = types.SimpleNamespace(num_hidden_layers=2, swa_layer_ids=[], sliding_window=None,
                               req_states=(("recurrent", 4096),))
    spec = kv_spec_for(sa, mc, 64 * PS)
    assert spec.req_states == (ReqStateSpec("recurrent", 4096),)
    assert "recurrent state of 4096 B per request" in spec.describe()
    assert LlamaForCausalLM.request_states(None, "float32", 1) == ()
    assert ModelConfig.__dataclass_fields__["req_states"].default == ()
