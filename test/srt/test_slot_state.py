"""The decode step's inputs read from the device's per-slot state (model_executor/slot_state.py) are the host-built
ones: for two data-parallel ranks at page size 4, after an extend step has written its rows (`write_rows`), the
ForwardBatch and SamplingBatch `decode_inputs` lays out for `DecodeRows` equal, on every real row, what
`ScheduleBatch.build_model_worker_batch` + `stack_ranks` give for the same requests; a row past its KV slots
(a multi-step decode's length stop) writes nothing. No model: the layouts only."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sgl_jax.srt.forward_batch import DecodeRows, ForwardMode, stack_ranks
from sgl_jax.srt.layers import pytrees  # noqa: F401  (registers the batch pytrees)
from sgl_jax.srt.mem_cache.kv_memory import KVMemory, plan_kv_cache
from sgl_jax.srt.model_executor.buckets import ShapeBuckets
from sgl_jax.srt.model_executor.future_tokens import resolve_placeholders, write_future
from sgl_jax.srt.model_executor.slot_state import decode_inputs, new_slot_state, write_rows
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.scheduler.schedule_batch import Req, ScheduleBatch

PAGE, CONTEXT, SLOTS = 4, 64, 4
BUCKETS = ShapeBuckets((32,), (4,))


def rank_reqs(r: int) -> list:
    params = [SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.8, min_new_tokens=2, stop_token_ids=[5, 6]),
              SamplingParams(max_new_tokens=9, temperature=0.0, frequency_penalty=0.5, ignore_eos=True),
              SamplingParams(max_new_tokens=9, temperature=1.0, top_k=3)][:3 - r]
    return [Req(f"r{r}.{i}", list(range(1 + i, 6 + 3 * i + r)), sp, eos_token_ids=[2], seed=40 + i)
            for i, sp in enumerate(params)]


def test_decode_inputs_equal_the_host_built_layout():
    spec = plan_kv_cache(256, PAGE, 2, [])
    memories = [KVMemory.create(spec, num_request_slots=SLOTS, context_len=CONTEXT, disable_radix_cache=True)
                for _ in range(2)]
    ranks = [rank_reqs(r) for r in range(2)]
    state = new_slot_state(2 * SLOTS, CONTEXT // PAGE)
    future = jnp.zeros((2 * SLOTS,), jnp.int32)
    # the extend step: every prompt, its rows written, a first token sampled (here: 100 + the stacked slot)
    extend = []
    for memory, reqs in zip(memories, ranks):
        for q in reqs:
            q.extend_input_len = len(q.origin_input_ids)
        batch = ScheduleBatch(reqs, ForwardMode.EXTEND)
        batch.prepare_for_extend(memory)
        extend.append(batch.build_model_worker_batch(BUCKETS, memory, (ForwardMode.EXTEND, 32, 4)))
    stacked = stack_ranks(extend, SLOTS)
    state = write_rows(state, stacked.forward_batch, stacked.sampling)
    slots = np.asarray(stacked.sampling.slots)
    future = write_future(future, slots, np.asarray(stacked.sampling.writes_future), 100 + slots)
    for r, reqs in enumerate(ranks):
        for q in reqs:
            q.kv_committed_len = q.kv_allocated_len
            q.output_ids.append(100 + r * SLOTS + q.req_pool_idx)
    # two decode steps: host-built against slot state (the second after the first's page-table entries)
    for step in range(2):
        host, rows = [], []
        for memory, reqs in zip(memories, ranks):
            batch = ScheduleBatch(reqs, ForwardMode.DECODE)
            assert batch.prepare_for_decode(memory)
            host.append(batch.build_model_worker_batch(BUCKETS, memory, (ForwardMode.DECODE, 4, 4)))
            rows.append(batch.build_decode_rows(memory, 4))
        ref = stack_ranks(host, SLOTS)
        drows = DecodeRows.stack(rows, SLOTS)
        real = np.asarray(ref.sampling.writes_future)
        input_ids = future[jnp.asarray(drows.slots)]
        fb, sampling, state = decode_inputs(state, jax.tree.map(jnp.asarray, drows), input_ids, 0,
                                            jnp.asarray(real), PAGE, False)
        want = ref.forward_batch
        ids = np.asarray(resolve_placeholders(jnp.asarray(want.input_ids), future))
        assert np.array_equal(np.asarray(fb.input_ids)[real], ids[real])
        for name in ("positions", "out_cache_loc", "kv_lens", "logits_indices"):
            assert np.array_equal(np.asarray(getattr(fb, name))[real], np.asarray(getattr(want, name))[real]), name
        for name in ("cu_q_lens", "num_seqs"):
            assert np.array_equal(np.asarray(getattr(fb, name)), np.asarray(getattr(want, name))), name
        for i in np.nonzero(real)[0]:  # the pages a row reads: those of its KV length
            n = -(-int(want.kv_lens[i]) // PAGE)
            assert np.array_equal(np.asarray(fb.page_indices)[i, :n], np.asarray(want.page_indices)[i, :n]), i
        for name in ("seeds", "steps", "suppress_eos", "slots", "penalized", "last_token_index", "min_new_tokens",
                     "ignore_eos", "stop_ids"):
            got, exp = np.asarray(getattr(sampling, name))[real], np.asarray(getattr(ref.sampling, name))[real]
            assert np.array_equal(got, exp), name
        for name, v in ref.sampling.params.items():
            assert np.array_equal(np.asarray(sampling.params[name])[real], np.asarray(v)[real]), name
        future = write_future(future, slots, real, 200 + step + slots)
        for r, reqs in enumerate(ranks):
            for q in reqs:
                q.kv_committed_len = q.kv_allocated_len
                q.output_ids.append(200 + step + r * SLOTS + q.req_pool_idx)
    # a live row past its KV slots (kv slot 0) writes no page-table entry
    before = np.asarray(state.page_table)
    drows = dataclasses.replace(drows, kv_slots=np.zeros_like(drows.kv_slots))
    _, _, after = decode_inputs(state, jax.tree.map(jnp.asarray, drows), input_ids, 0,
                                jnp.zeros(len(real), bool), PAGE, False)
    assert np.array_equal(np.asarray(after.page_table), before)


def test_decode_rows_packed_buffer_is_the_packed_layout():
    """DecodeRows.build's one buffer (what the decode step copies to the device) is `packed_inputs.pack` of its
    fields, and the fields read it: K = 2 steps, 3 real rows of 4."""
    from sgl_jax.srt.model_executor.packed_inputs import pack

    rows = DecodeRows.build([5, 1, 7], [11, -2, 13], [40, 41, 42], np.array([[90, 91, 92], [93, 94, 0]]),
                            [3, 4, 5], [False, True, False], 4)
    ref, _ = pack(rows)
    np.testing.assert_array_equal(rows.packed, ref)
    assert rows.constrained.dtype == np.bool_ and rows.constrained.tolist() == [False, True, False, False]
    assert rows.kv_slots.tolist() == [[90, 91, 92, 0], [93, 94, 0, 0]] and int(rows.num_seqs[0]) == 3
    assert [rows.slots.tolist(), rows.input_ids.tolist(), rows.positions.tolist(), rows.steps.tolist()] == [
        [5, 1, 7, 0], [11, -2, 13, 0], [40, 41, 42, 0], [3, 4, 5, 0]]


@pytest.mark.parametrize("n_reqs", [3, 12])
@pytest.mark.parametrize("page", [1, 4, 16])
def test_multi_step_decode_slots_continue_each_page(page, n_reqs):
    """`allocate_decode` with counts (a K-step decode's slots, --num-continuous-decode-steps) gives every position
    of every request the slot one-position-at-a-time allocation would: each position in its request's page for
    that position (the last partly filled page continued first), at its offset in the page, no page held by two
    requests, and exactly the new pages taken. At page 16 the first K = 4 block of these prompts fits in the pages
    they have (no new page at all: an IndexError before the fix, seen on a GPU, whose default page is 16).
    3 requests take `write_positions_each`'s way, 12 `write_positions_batched`'s (more than FEW_ROWS)."""
    from sgl_jax.srt.mem_cache.kv_memory import FEW_ROWS

    assert 3 <= FEW_ROWS < 12
    spec = plan_kv_cache(1024, page, 2, [])
    memory = KVMemory.create(spec, num_request_slots=max(SLOTS, n_reqs), context_len=CONTEXT,
                             disable_radix_cache=True)
    reqs = rank_reqs(0)
    reqs += [Req(f"more.{i}", list(range(1 + i, 6 + 2 * i)), reqs[i % 3].sampling_params, eos_token_ids=[2], seed=i)
             for i in range(n_reqs - len(reqs))]
    for q in reqs:
        q.extend_input_len = len(q.origin_input_ids)
    batch = ScheduleBatch(reqs, ForwardMode.EXTEND)
    batch.prepare_for_extend(memory)
    for q in reqs:
        q.kv_committed_len = q.kv_allocated_len
        q.output_ids.append(3)
    table = memory.req_to_token_pool.req_to_token
    for k in (4, 1, 7, 4):
        free_before = memory.allocator.available_pages()
        pages_before = sum(-(-q.kv_allocated_len // page) for q in reqs)
        assert memory.allocate_decode(reqs, [k] * len(reqs))
        for q in reqs:
            end = q.seqlen_ahead - 1 + k
            assert q.kv_allocated_len == end
            slots = table[q.req_pool_idx, :end]
            np.testing.assert_array_equal(slots % page, np.arange(end) % page)
            for p in range(-(-end // page)):  # one page per page index
                assert len(set(slots[p * page:(p + 1) * page] // page)) == 1, (q.rid, p)
        owned = np.concatenate([np.unique(table[q.req_pool_idx, :q.kv_allocated_len] // page) for q in reqs])
        assert len(np.unique(owned)) == len(owned) and 0 not in owned
        pages_after = sum(-(-q.kv_allocated_len // page) for q in reqs)
        assert free_before - memory.allocator.available_pages() == pages_after - pages_before
        for q in reqs:
            q.output_ids.extend([3] * k)
            q.kv_committed_len = q.kv_allocated_len
    for q in reqs:
        memory.release(q)
    assert memory.free_tokens() == memory.size


@pytest.mark.parametrize("page", [1, 4])
def test_few_request_decode_steps_equal_the_batched_way(page, monkeypatch):
    """A small batch's decode step (`KVMemory.allocate_decode`'s scalar way for up to FEW_ROWS requests, and
    `build_decode_rows`' `DecodeRows.from_rows` for up to FEW_ROWS rows) takes the same pages, writes the
    same slots and packs the same rows as the numpy way the larger batches take: 3 requests, 9 one-step decodes
    from prompts of 5, 7 and 9 tokens (page 4: each crosses a page boundary at least twice)."""
    from sgl_jax.srt.mem_cache import kv_memory
    from sgl_jax.srt.scheduler import schedule_batch

    spec = plan_kv_cache(256, page, 2, [])
    runs = {}
    for way in ("few", "batched"):
        if way == "batched":
            monkeypatch.setattr(kv_memory, "FEW_ROWS", 0)
            monkeypatch.setattr(schedule_batch, "FEW_ROWS", 0)
        memory = KVMemory.create(spec, num_request_slots=SLOTS, context_len=CONTEXT, disable_radix_cache=True)
        reqs = rank_reqs(0)
        for q in reqs:
            q.extend_input_len = len(q.origin_input_ids)
        ScheduleBatch(reqs, ForwardMode.EXTEND).prepare_for_extend(memory)
        packed, free = [], []
        for step in range(9):
            for q in reqs:
                q.kv_committed_len = q.kv_allocated_len
                q.output_ids.append(7 + step)
            batch = ScheduleBatch(reqs, ForwardMode.DECODE)
            assert batch.prepare_for_decode(memory)
            rows = batch.build_decode_rows(memory, 4)
            packed.append(rows.packed.copy())
            assert rows.constrained.dtype == np.bool_
            free.append(memory.allocator.free_page_ids())
        table = memory.req_to_token_pool.req_to_token
        runs[way] = (packed, free, [table[q.req_pool_idx, :q.kv_allocated_len].copy() for q in reqs],
                     [q.kv_allocated_len for q in reqs])
        # every page the requests hold goes back at once: a page held twice, or one the free list still marks
        # free (its double-free check), raises here
        memory.allocator.free_pages(np.concatenate([np.unique(t // page) for t in runs[way][2]]))
    (p1, f1, t1, n1), (p2, f2, t2, n2) = runs["few"], runs["batched"]
    assert n1 == n2 == [q + 9 for q in (5, 7, 9)]
    for a, b in zip(p1 + f1 + t1, p2 + f2 + t2):
        np.testing.assert_array_equal(a, b)


def test_decode_rows_from_rows_equal_build():
    """`DecodeRows.from_rows` (a one-step decode's rows as tuples) gives `DecodeRows.build`'s buffer and fields."""
    rows = [(5, 11, 40, 90, 3, False), (1, -2, 41, 91, 4, True), (7, 13, 42, 92, 5, False)]
    a = DecodeRows.from_rows(rows, 4)
    cols = list(zip(*rows))
    b = DecodeRows.build(cols[0], cols[1], cols[2], np.array([cols[3]]), cols[4], cols[5], 4)
    np.testing.assert_array_equal(a.packed, b.packed)
    for name in ("slots", "input_ids", "positions", "kv_slots", "steps", "constrained", "num_seqs"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    with pytest.raises(ValueError, match="do not fit"):
        DecodeRows.from_rows(rows, 2)
