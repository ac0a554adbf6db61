"""Per-request rows (mem_cache/req_state.ReqRowsPool: a vision tower's embedding rows, a variable number per request)
through one rank's KVMemory and admission, no model: a request takes the pages of its rows with its request slot at
its extend and gives them back on the one release path (finish, abort, retract, a streaming session's turn);
admission only admits a request whose rows are free; the accounting (``<name>_pages_*``) and the exact and idle
checks see them, and report a planted leak, a page owned twice and a free request slot holding pages."""

import random
import types

import numpy as np
import pytest

from sgl_jax.srt import fault_injection
from sgl_jax.srt.forward_batch import ForwardMode
from sgl_jax.srt.mem_cache.common import release_kv_cache
from sgl_jax.srt.mem_cache.kv_invariants import req_row_problems
from sgl_jax.srt.mem_cache.kv_memory import KVCacheSpec, KVMemory, kv_spec_for
from sgl_jax.srt.mem_cache.req_state import ReqRowsPool, ReqRowsSpec, reserve_bytes
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.models.llama import LlamaForCausalLM
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.scheduler.admission import PrefillAdder
from sgl_jax.srt.scheduler.schedule_batch import FinishReason, Req, ScheduleBatch, finish_abort

PS = 4
# 4 request slots x 2 pages of 8 rows: 8 pages of "vision" rows
ROWS = (ReqRowsSpec("vision", 64, 16, page_rows=8),)


def new_memory(monkeypatch, **env) -> KVMemory:
    """A rank's KVMemory (radix cache, 4 request slots, 64 KV pages) whose spec carries ROWS, with planted faults
    `env` (fault_injection's names -> values)."""
    for name, value in env.items():
        monkeypatch.setenv(getattr(fault_injection, name), value)
    spec = KVCacheSpec(PS, (64 * PS,), (0,), req_rows=ROWS)
    flags = types.SimpleNamespace(disable_radix_cache=False, radix_eviction_policy="lru")
    return KVMemory.create(spec, num_request_slots=4, context_len=128, server_args=flags)


def new_req(ids, rid: str, rows: int, session=None) -> Req:
    req = Req(rid, ids, SamplingParams(max_new_tokens=4), eos_token_ids=[], seed=0)
    req.rows_needed = {"vision": rows} if rows else {}
    req.session_kv = session
    return req


def try_admit(memory: KVMemory, *reqs: Req) -> list:
    """One admission round over `reqs` (PrefillAdder, as the scheduler) and the extend of those admitted (their
    K/V written); returns the admitted."""
    adder = PrefillAdder(ShapeBuckets((64,), (1, 4)), memory, [], max_prefill_tokens=64, chunk_size=None,
                         free_req_slots=memory.free_req_slots(), new_token_ratio=1.0)
    admitted = [r for r in reqs if adder.add(r)]
    if admitted:
        ScheduleBatch(admitted, ForwardMode.EXTEND).prepare_for_extend(memory)
    for req in admitted:
        req.kv_committed_len = req.kv_allocated_len
        req.output_ids.append(7)
    return admitted


def admit(memory: KVMemory, ids, rid: str, rows: int, session=None) -> Req:
    req = new_req(ids, rid, rows, session)
    assert try_admit(memory, req) == [req]
    return req


def finish(memory: KVMemory, req: Req) -> None:
    req.finished_reason = FinishReason("length", length=1)
    memory.release(req)


def pages_in_use(memory: KVMemory) -> int:
    return memory.accounting()["vision_pages_in_use"]


def test_a_request_holds_its_rows_from_its_extend_to_its_release(monkeypatch):
    memory = new_memory(monkeypatch)
    acc = memory.accounting()
    assert {k: acc[k] for k in acc if k.startswith("vision")} == {
        "vision_pages_total": 8, "vision_pages_free": 8, "vision_pages_in_use": 0}
    a = admit(memory, list(range(10, 30)), "a", rows=20)  # 3 pages of 8 rows
    b = admit(memory, list(range(40, 60)), "b", rows=0)  # a text-only request takes none
    c = admit(memory, list(range(70, 90)), "c", rows=8)  # 1 page
    pool = memory.req_to_token_pool
    assert pages_in_use(memory) == 4 and pool.row_counts[0, b.req_pool_idx] == 0
    ids_a = pool.row_ids(0, a.req_pool_idx)
    pages_a = pool.row_pages[0][a.req_pool_idx]
    assert len(ids_a) == 20 and ids_a.tolist() == [int(pages_a[j // 8]) * 8 + j % 8 for j in range(20)]
    assert not set(ids_a) & set(pool.row_ids(0, c.req_pool_idx))  # two requests never share a row
    assert memory.check_invariants([a, b, c]) == []
    finish(memory, a)
    c.finished_reason = finish_abort("client went away")
    memory.release(c)
    assert pages_in_use(memory) == 0 and memory.check_invariants([b]) == []
    finish(memory, b)
    d = admit(memory, list(range(10, 30)), "d", rows=16)
    release_kv_cache(d, memory.tree_cache, is_insert=False)  # retracted: its rows are computed again on its return
    d.reset_for_retract()
    assert pages_in_use(memory) == 0 and memory.idle_problems([]) == []
    assert try_admit(memory, d) == [d] and pages_in_use(memory) == 2  # back: it takes them again
    finish(memory, d)
    assert memory.idle_problems([]) == []


def test_admission_waits_for_rows_and_a_later_chunk_takes_none(monkeypatch):
    """KV is plentiful, but the rows of the first request leave too few pages for the second: it waits (nothing
    taken), and is admitted once the first is released. A request's second extend (its next chunk) keeps its
    rows."""
    memory = new_memory(monkeypatch)
    a = admit(memory, list(range(10, 30)), "a", rows=48)  # 6 of 8 pages
    b, c = new_req(list(range(40, 60)), "b", rows=24), new_req(list(range(70, 90)), "c", rows=0)
    assert try_admit(memory, b, c) == [c]  # b needs 3 pages, 2 are free; c needs none
    assert b.req_pool_idx is None and pages_in_use(memory) == 6 and memory.check_invariants([a, c]) == []
    finish(memory, a)
    assert try_admit(memory, b) == [b] and pages_in_use(memory) == 3
    assert memory.check_invariants([b, c]) == []
    finish(memory, b)
    d = new_req(list(range(100, 124)), "d", rows=24)  # its prompt in two chunks of 12, as chunked prefill runs it
    d.extend_input_len = 12
    memory.allocate_extend(d)
    pool = memory.req_to_token_pool
    pages = pool.row_pages[0][d.req_pool_idx].copy()
    d.kv_committed_len = d.kv_allocated_len
    memory.allocate_extend(d)  # the next chunk keeps the request's rows
    d.kv_committed_len = d.kv_allocated_len
    d.output_ids.append(7)
    assert pool.row_pages[0][d.req_pool_idx].tolist() == pages.tolist() and pages_in_use(memory) == 3
    assert memory.check_invariants([c, d]) == []
    for r in (c, d):
        finish(memory, r)
    assert memory.idle_problems([]) == []
    with pytest.raises(ValueError, match=r"no per-request rows named 'audio' \(it has \['vision'\]\)"):
        bad = new_req(list(range(40, 60)), "bad", rows=0)
        bad.rows_needed = {"audio": 4}
        try_admit(memory, bad)
    assert memory.idle_problems([]) == []  # (its prefix lock undone)
    # what intake rejects: a request that could never be admitted
    assert memory.rows_problem({"vision": 64}) is None
    assert memory.rows_problem({"vision": 65}) == "65 vision rows need 9 pages; the pool holds 8"
    assert memory.rows_problem({"audio": 1}) == "this model has no per-request rows named 'audio' (it has ['vision'])"


def test_a_streaming_session_holds_no_rows_between_turns(monkeypatch):
    memory = new_memory(monkeypatch)
    session = memory.new_session_kv()
    t1 = admit(memory, list(range(10, 30)), "t1", rows=16, session=session)
    finish(memory, t1)
    assert session.has_kv() and pages_in_use(memory) == 0 and memory.idle_problems([session]) == []
    t2 = admit(memory, t1.fill_ids + [5, 6], "t2", rows=8, session=session)  # the turn's own image
    assert pages_in_use(memory) == 1
    assert memory.req_to_token_pool.row_counts[0, t2.req_pool_idx] == 8
    finish(memory, t2)
    assert pages_in_use(memory) == 0 and memory.idle_problems([session]) == []
    memory.release_session(session)
    assert memory.idle_problems([]) == []


def test_row_pools_run_out_without_taking_anything():
    pools = [ReqRowsPool(ReqRowsSpec("vision", 4, 8, page_rows=4), 4), ReqRowsPool(ReqRowsSpec("audio", 4, 4), 1)]
    pool = ReqToTokenPool(3, 16, row_pools=pools)
    r0, r1 = pool.alloc(), pool.alloc()
    assert pool.alloc_rows(r0, {"vision": 9, "audio": 3})  # 3 + 1 pages
    assert not pool.alloc_rows(r1, {"vision": 4, "audio": 1})  # vision fits, audio has none left: nothing taken
    assert [p.available_size() for p in pools] == [1, 0] and pool.row_counts[:, r1].tolist() == [0, 0]
    with pytest.raises(ValueError, match=f"request slot {r0} holds rows already"):
        pool.alloc_rows(r0, {"vision": 1})
    pool.free(r0)  # the slot's rows go with it
    assert [p.available_size() for p in pools] == [4, 1] and pool.row_counts[:, r0].tolist() == [0, 0]
    assert req_row_problems(pool) == []


def test_random_allocs_and_frees_keep_every_page_owned_once():
    rng = random.Random(0)
    pool = ReqToTokenPool(6, 8, row_pools=[ReqRowsPool(ReqRowsSpec("vision", 4, 8, page_rows=4), 12)])
    held = []
    for _ in range(500):
        if held and (rng.random() < 0.5 or not pool.available_size()):
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            idx = pool.alloc()
            if not pool.alloc_rows(idx, {"vision": rng.randrange(0, 20)}):
                assert pool.row_counts[0, idx] == 0
            held.append(idx)
        assert req_row_problems(pool) == []
        in_use = sum(len(pool.row_pages[0][r]) for r in held)
        assert in_use + pool.row_pools[0].available_size() == 12


def test_planted_faults_are_reported(monkeypatch):
    """A page dropped at the first finished request (LEAK_ROWS_ENV) fails the idle check; a held page also on the
    free list, and a free request slot holding pages (its pages then owned by nobody), fail the exact check."""
    leaky = new_memory(monkeypatch, LEAK_ROWS_ENV="1")
    finish(leaky, admit(leaky, list(range(10, 30)), "a", rows=8))
    problems = leaky.idle_problems([])
    assert any("vision pages owned by nobody (leaked)" in p for p in problems), problems
    assert not any("twice" in p for p in problems)
    monkeypatch.delenv(fault_injection.LEAK_ROWS_ENV)

    twice = new_memory(monkeypatch)
    req = admit(twice, list(range(10, 30)), "a", rows=16)
    pages = twice.req_to_token_pool.row_pages[0][req.req_pool_idx]
    twice.req_to_token_pool.row_pools[0]._free.push_unchecked(pages[1:])
    assert twice.check_invariants([req]) == [f"vision pages owned twice: {pages[1:].tolist()}"]

    stale = new_memory(monkeypatch)
    pool = stale.req_to_token_pool
    free_row = pool.free_slot_ids()[0]
    pool.row_pages[0][free_row], pool.row_counts[0, free_row] = pool.row_pools[0].alloc(8), 8
    problems = stale.check_invariants([])
    assert f"vision rows: free request slots [{free_row}] hold pages" in problems, problems
    assert "vision pages: 1 in use with nothing running" in stale.idle_problems([])


def test_the_spec_and_reserve_take_the_model_configs_rows_and_the_decoder_stack_has_none():
    sa = types.SimpleNamespace(disable_hybrid_swa_memory=False, page_size=PS, swa_full_tokens_ratio=0.8)
    mc = types.SimpleNamespace(num_hidden_layers=2, swa_layer_ids=[], sliding_window=None,
                               req_rows=(("vision", 1024, 20),))
    spec = kv_spec_for(sa, mc, 64 * PS)
    assert spec.req_rows == (ReqRowsSpec("vision", 1024, 20),)
    assert "vision rows of 1024 B, 20 per request" in spec.describe()
    # 20 rows take 2 pages of 16 rows: 32 rows of 1 KiB per request slot, plus a 100-byte state slot
    assert reserve_bytes((("recurrent", 100),), mc.req_rows, 4) == 4 * (100 + 32 * 1024)
    assert LlamaForCausalLM.request_rows(None, "float32", 1) == ()
    memory = KVMemory.create(spec, num_request_slots=3, context_len=64)
    assert memory.accounting()["vision_pages_total"] == 6
    assert np.all(memory.req_to_token_pool.row_counts == 0)
