"""LoRA's pure bookkeeping without a model: device slots (srt/lora/slots.py), the adapter registry and
--lora-paths (srt/lora/registry.py), the scheduler's slot placement (scheduler/lora_control.py), and the radix
cache's namespaces (one per adapter)."""

import types

import numpy as np
import pytest

from sgl_jax.srt.lora.peft_adapter import LoraAdapter, normalize_target_modules
from sgl_jax.srt.lora.registry import LoraRef, LoraRegistry, LoraShape, parse_lora_paths
from sgl_jax.srt.lora.slots import AdapterSlots
from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.kv_invariants import lock_problems
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sgl_jax.srt.scheduler.lora_control import SchedulerLora


def adapter(name: str, rank: int = 4, targets=("q_proj",)) -> LoraAdapter:
    w = {(0, t): (np.zeros((rank, 8), np.float32), np.zeros((8, rank), np.float32)) for t in targets}
    return LoraAdapter(name=name, path=f"/a/{name}", rank=rank, targets=tuple(targets), weights=w)


def test_slots_reuse_the_least_recently_used_idle_slot():
    slots = AdapterSlots(2)
    assert slots.place(1, busy=()) == (0, True)
    assert slots.place(2, busy=()) == (1, True)
    assert slots.place(1, busy=()) == (0, False)  # already there: no write; 1 is now the most recent
    assert slots.place(3, busy=()) == (1, True)  # evicts 2, the least recently used
    assert slots.place(2, busy={0, 1}) == (None, False)  # every slot busy: wait
    assert slots.place(2, busy={1}) == (0, True)  # slot 0 is the only idle one
    assert slots.drop(3) == 1 and slots.occupied() == [(0, 2)]


def test_registry_capacity_evicts_lru_idle_unpinned():
    reg = LoraRegistry(LoraShape(slots=2, rank=8, targets=("q_proj", "v_proj")), capacity=2)
    a, _ = reg.add(adapter("a"), pinned=True, in_use=lambda n: False)
    reg.add(adapter("b"), pinned=False, in_use=lambda n: False)
    reg.get("a")  # (a more recent than b, but pinned anyway)
    _, evicted = reg.add(adapter("c"), pinned=False, in_use=lambda n: False)
    assert evicted == ["b"] and set(reg.adapters) == {"a", "c"}
    with pytest.raises(ValueError, match="pinned or in use"):
        reg.add(adapter("d"), pinned=False, in_use=lambda n: n == "c")
    with pytest.raises(ValueError, match="already loaded"):
        reg.add(adapter("a"), pinned=False, in_use=lambda n: False)
    with pytest.raises(ValueError, match="rank 16, more than --max-lora-rank 8"):
        LoraRegistry(reg.shape).add(adapter("big", 16), False, lambda n: False)
    with pytest.raises(ValueError, match="targets \\['down_proj'\\]"):
        LoraRegistry(reg.shape).add(adapter("mlp", 4, ("down_proj",)), False, lambda n: False)
    assert reg.adapters["c"].uid > a.uid  # every load a new uid (the radix namespace)


def test_lora_paths_forms_and_errors():
    refs = parse_lora_paths(["x=/p/x", "/p/y", '{"lora_name": "z", "lora_path": "org/z", "pinned": true}'])
    assert refs == [LoraRef("x", "/p/x"), LoraRef("/p/y", "/p/y"), LoraRef("z", "org/z", True)]
    for bad, why in ((["x=/a", "x=/b"], "given twice"), (["=/a"], "needs a name"), (['{"lora_path": 1}'], "JSON")):
        with pytest.raises(ValueError, match=why):
            parse_lora_paths(bad)
    assert normalize_target_modules(["all"])[-1] == "down_proj"
    with pytest.raises(ValueError, match="lm_head"):
        normalize_target_modules(["q_proj", "lm_head"])


def test_placement_leaves_slots_of_running_and_just_admitted_requests_alone():
    writes = []
    live = []
    writer = types.SimpleNamespace(write=lambda s, a: writes.append((s, a.name)) or 0.0, check=lambda a: None)
    lora = SchedulerLora(LoraShape(2, 4, ("q_proj",)), None, writer, lambda: live, lambda: live)
    for name in ("a", "b", "c"):
        lora.registry.add(adapter(name), False, lora.in_use)

    def req(name):
        return types.SimpleNamespace(lora_name=name, cache_namespace=lora.uid_of(name), lora_slot=-1,
                                     req_pool_idx=None)

    ra, rb, rc = req("a"), req("b"), req("c")
    assert lora.place(ra, []) and lora.place(rb, [ra])
    assert not lora.place(rc, [ra, rb]), "evicted a slot a request admitted in the same round reads"
    ra.req_pool_idx = 0  # a is running; b was not admitted after all
    live.append(ra)
    assert lora.place(rc, []) and rc.lora_slot == rb.lora_slot and writes[-1] == (rb.lora_slot, "c")


def test_radix_namespaces_are_apart_and_cleaned_up():
    pool, alloc = ReqToTokenPool(4, 64), PagedTokenToKVPoolAllocator(64, 1)
    cache = RadixCache(pool, alloc, 1)

    def slots(n):
        row = np.zeros(64, np.int32)
        row[:n] = alloc.alloc_token_slots(row, 0, n)
        return row[:n].copy()

    base, lora = slots(4), slots(4)
    assert cache.insert([1, 2, 3, 4], base) == 0
    assert cache.match_prefix([1, 2, 3, 4], namespace=7).length == 0  # the base's prefix is not the adapter's
    assert cache.prefix_match_len([1, 2, 3, 4], namespace=7) == 0
    assert cache.insert([1, 2, 3, 4], lora, namespace=7) == 0  # (a copy of its own)
    m = cache.match_prefix([1, 2, 3, 4, 5], namespace=7)
    assert m.device_indices.tolist() == lora.tolist()
    assert cache.match_prefix([1, 2, 3], namespace=8).length == 0
    cache.inc_lock_ref(m.last_node)
    assert lock_problems(cache, [types.SimpleNamespace(last_node=m.last_node)]) == []
    cache.dec_lock_ref(m.last_node)
    assert cache.evictable_size() == 8 and cache.evict(8) == 8
    assert cache.namespace_roots() == [] and list(cache.root.children) == [], "an emptied namespace stays"
    # an unloaded adapter's prefixes are freed at once (a locked one stays until its holder lets go)
    free = alloc.available_size()
    assert cache.insert([1, 2, 3, 4], slots(4)) == 0 and cache.insert([1, 2], slots(2), namespace=9) == 0
    assert cache.insert([1, 2, 3, 4, 5, 6], np.concatenate([cache.match_prefix([1, 2], 9).device_indices,
                                                         slots(4)]), namespace=9) == 2
    held = cache.match_prefix([1, 2], namespace=9)
    cache.inc_lock_ref(held.last_node)  # (a request still holds [1, 2])
    assert cache.evict_namespace(9) == 4 and cache.match_prefix([1, 2, 3, 4], namespace=9).length == 2
    cache.dec_lock_ref(held.last_node)
    assert cache.evict_namespace(9) == 2 and cache.namespace_roots() == []
    assert cache.match_prefix([1, 2, 3, 4]).length == 4 and cache.evict_namespace(123) == 0
    assert alloc.available_size() == free - 4 and cache.evictable_size() == 4


def test_a_request_waiting_for_a_slot_does_not_block_the_ones_behind_it():
    """Admission: every slot busy with a running request's adapter, a request for another adapter waits while a
    base-model request behind it is admitted (SGLang skips such a request instead of stopping there)."""
    from sgl_jax.srt.mem_cache.kv_memory import KVMemory
    from sgl_jax.srt.model_executor.buckets import ShapeBuckets
    from sgl_jax.srt.sampling.sampling_params import SamplingParams
    from sgl_jax.srt.scheduler.admission import AdmissionPolicy
    from sgl_jax.srt.scheduler.schedule_batch import Req
    from sgl_jax.srt.scheduler.scoring import SchedulerScoring

    pool, alloc = ReqToTokenPool(4, 256), PagedTokenToKVPoolAllocator(1024, 16)
    memory = KVMemory(pool, alloc, RadixCache(pool, alloc, 16))
    running = []
    writer = types.SimpleNamespace(write=lambda s, a: 0.0, check=lambda a: None)
    lora = SchedulerLora(LoraShape(1, 4, ("q_proj",)), None, writer, lambda: running, lambda: running)
    for name in ("a", "b"):
        lora.registry.add(adapter(name), False, lora.in_use)

    def req(rid, name=None):
        return Req(rid, [5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0.0), eos_token_ids=[2], seed=0,
                   lora_name=name, lora_uid=None if name is None else lora.uid_of(name))

    holder = req("holder", "a")
    assert lora.place(holder, []) and holder.lora_slot == 0
    holder.req_pool_idx = 0
    running.append(holder)
    admission = AdmissionPolicy(buckets=ShapeBuckets((64,), (1, 4)), max_running_requests=4, max_prefill_tokens=64,
                                chunk_size=None, memory=memory, scoring=SchedulerScoring(memory, 60.0,
                                                                                         lambda msg: None, [2]),
                                lora=lora)
    waiting, base = req("waits", "b"), req("base")
    decided = admission.admit([waiting, base], [], None)
    assert [r.rid for r in decided.can_run] == ["base"] and waiting.lora_slot == -1
