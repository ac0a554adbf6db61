"""The sharding-plan benchmark (python/sgl_jax/bench_sharding.py): weight and KV bytes per device from shapes, dense
models under tensor parallelism and MoE models under expert parallelism; the generated report with its raw rows in a
.json beside it."""

import json

import pytest

from sgl_jax.bench_sharding import (DEVICES, MEM_FRACTION, MOE_TABLE_HEADER, QUANT_TABLE_HEADER, TABLE_HEADER,
                                    format_moe_table, moe_plan, plan, quant_plan, write_report)

# Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json), counted by hand
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 4096, 32, 32, 8, 128, 14336, 128256


def _llama3_8b_params() -> int:
    attn = HIDDEN * HEADS * HEAD_DIM * 2 + HIDDEN * KV_HEADS * HEAD_DIM * 2  # q, o; k, v
    mlp = 3 * HIDDEN * INTER  # gate, up, down
    norms = 2 * HIDDEN
    return LAYERS * (attn + mlp + norms) + 2 * VOCAB * HIDDEN + HIDDEN  # + embed, lm_head (untied), final norm


@pytest.fixture(scope="module")
def rows():
    return {r["tp"]: r for r in plan(models=["Llama-3-8B"], tp_sizes=(1, 4, 8))}


def test_tp1_weights_are_exact_bf16_parameter_bytes(rows):
    assert _llama3_8b_params() == 8_030_261_248
    assert rows[1]["weight_bytes"] == _llama3_8b_params() * 2  # ~16.06e9 bytes, ~14.96 GiB


def test_tp4_weights_split_four_ways(rows):
    total = rows[1]["weight_bytes"]
    assert total / 4 <= rows[4]["weight_bytes"] <= total / 4 * 1.05


def test_kv_per_token_split_over_the_eight_kv_heads(rows):
    assert rows[1]["kv_bytes_per_1k"] == 2 * LAYERS * KV_HEADS * HEAD_DIM * 2 * 1024
    assert rows[8]["kv_bytes_per_1k"] * 8 == rows[1]["kv_bytes_per_1k"]
    assert rows[8]["v6e_tokens"] > rows[4]["v6e_tokens"] > rows[1]["v6e_tokens"] > 0


def test_report_has_the_table(rows, tmp_path):
    out = tmp_path / "reports" / "plan.md"
    write_report(str(out), list(rows.values()), "python -m sgl_jax.bench_sharding --output plan.md")
    text = out.read_text()
    assert TABLE_HEADER in text
    assert "computed from shapes, no device needed" in text.lower()
    assert "| Llama-3-8B | 1 | 14.96 | 128 |" in text
    raw = json.loads((out.parent / "plan.json").read_text())  # the raw rows beside the generated .md
    assert raw["command"] in text and raw["rows"] == list(rows.values())


def test_quantized_plans_count_one_byte_per_linear_weight_and_its_scales(rows, tmp_path):
    """--quantization int8 / fp8: each projection's weight in one byte plus a float32 scale per output channel, the
    embedding table and LM head in one byte plus a float32 scale per 128 values (methods.table_scheme), the norms
    bfloat16; --kv-cache-dtype fp8_e4m3 halves the KV bytes; the report gains their table."""
    linear = LAYERS * (HIDDEN * HEADS * HEAD_DIM * 2 + HIDDEN * KV_HEADS * HEAD_DIM * 2 + 3 * HIDDEN * INTER)
    scales = LAYERS * (HEADS * HEAD_DIM * 2 + KV_HEADS * HEAD_DIM * 2 + HIDDEN + 2 * INTER)
    tables = 2 * VOCAB * HIDDEN
    quant = {(r["quantization"], r["kv_cache_dtype"], r["tp"]): r for r in quant_plan(["Llama-3-8B"], (1, 4))}
    for method in ("int8", "fp8"):
        r = quant[(method, "auto", 1)]
        assert r["weight_bytes"] == (2 * (_llama3_8b_params() - linear - tables) + linear + 4 * scales
                                     + tables + 4 * tables // 128)
        assert r["kv_bytes_per_1k"] == rows[1]["kv_bytes_per_1k"]
    # the issue's goal: at most 0.55x of bfloat16's bytes (the scales are the rest above one half)
    assert 0.50 < quant[("int8", "auto", 1)]["weight_bytes"] / rows[1]["weight_bytes"] < 0.51
    (q32,), (b32,) = quant_plan(["Qwen3-32B"], (1,))[:1], plan(["Qwen3-32B"], (1,))
    assert 0.50 < q32["weight_bytes"] / b32["weight_bytes"] < 0.51
    assert quant[("fp8", "fp8_e4m3", 4)]["kv_bytes_per_1k"] * 2 == rows[4]["kv_bytes_per_1k"]
    out = tmp_path / "plan.md"
    write_report(str(out), list(rows.values()), "python -m sgl_jax.bench_sharding", quant_rows=list(quant.values()))
    text = out.read_text()
    assert QUANT_TABLE_HEADER in text and "| Llama-3-8B | fp8 | fp8_e4m3 | 4 |" in text


# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): every layer sparse
Q_HIDDEN, Q_LAYERS, Q_HEADS, Q_KV_HEADS, Q_HEAD_DIM = 2048, 48, 32, 4, 128
Q_EXPERTS, Q_MOE_INTER, Q_VOCAB = 128, 768, 151936
# Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1 config.json): 8 experts of intermediate_size
M_HIDDEN, M_LAYERS, M_EXPERTS, M_INTER = 4096, 32, 8, 14336


def _expert_bytes(experts: int, hidden: int, inter: int, layers: int) -> int:
    """bf16 bytes of every layer's stacked experts, all on one device (ep 1): gate, up, down [E, hidden, inter]."""
    return 3 * experts * hidden * inter * 2 * layers


def _qwen3_moe_attention_bytes(tp: int) -> int:
    """bf16 bytes of Qwen3-30B-A3B's attention per device at tp: q/o split, k/v split after the KV heads are
    replicated up to tp, the per-head q/k norms [head_dim] replicated."""
    kv_heads = max(Q_KV_HEADS, tp)
    proj = 2 * Q_HEADS * Q_HEAD_DIM * Q_HIDDEN + 2 * kv_heads * Q_HEAD_DIM * Q_HIDDEN  # q, o; k, v
    return Q_LAYERS * 2 * (proj // tp + 2 * Q_HEAD_DIM)


@pytest.fixture(scope="module")
def moe_rows():
    return {(r["model"], r["ep"]): r for r in moe_plan(models=["Qwen3-30B-A3B", "Mixtral-8x7B"], ep_sizes=(8, 16))}


def test_experts_split_ep_ways(moe_rows):
    qwen_all = _expert_bytes(Q_EXPERTS, Q_HIDDEN, Q_MOE_INTER, Q_LAYERS)  # ~54 GiB on one device
    assert moe_rows[("Qwen3-30B-A3B", 8)]["expert_bytes"] * 8 == qwen_all
    assert moe_rows[("Qwen3-30B-A3B", 16)]["expert_bytes"] * 16 == qwen_all
    assert moe_rows[("Mixtral-8x7B", 8)]["expert_bytes"] * 8 == _expert_bytes(M_EXPERTS, M_HIDDEN, M_INTER, M_LAYERS)
    assert moe_rows[("Qwen3-30B-A3B", 8)]["experts_per_device"] == 16


def test_attention_follows_tp_and_the_rest_is_vocab_split_or_replicated(moe_rows):
    for ep in (8, 16):
        r = moe_rows[("Qwen3-30B-A3B", ep)]
        assert r["attention_bytes"] == _qwen3_moe_attention_bytes(ep)
        vocab = 2 * Q_VOCAB * Q_HIDDEN * 2 // ep  # embed_tokens, lm_head (untied), split on the vocabulary
        replicated = 2 * (Q_LAYERS * (Q_EXPERTS * Q_HIDDEN + 2 * Q_HIDDEN) + Q_HIDDEN)  # routers, layer norms, norm
        assert r["weight_bytes"] == r["expert_bytes"] + r["attention_bytes"] + vocab + replicated
    # 4 KV heads replicated up to tp: one head per device at ep 8 and 16
    assert moe_rows[("Qwen3-30B-A3B", 16)]["kv_bytes_per_1k"] == 2 * Q_LAYERS * 1 * Q_HEAD_DIM * 2 * 1024


def test_mixtral_at_ep16_is_reported_impossible(moe_rows):
    r = moe_rows[("Mixtral-8x7B", 16)]
    assert r["problem"] == "8 experts do not divide over 16" and "weight_bytes" not in r
    assert moe_rows[("Mixtral-8x7B", 8)]["problem"] is None
    table = format_moe_table(list(moe_rows.values()))
    assert "| Mixtral-8x7B | 16 | — (8 experts do not divide over 16) | — |" in table


def test_qwen3_235b_at_ep4_does_not_fit_either_device():
    (r,) = moe_plan(models=["Qwen3-235B-A22B"], ep_sizes=(4,))
    assert r["weight_bytes"] > MEM_FRACTION * max(DEVICES.values())  # ~110 GiB of weights per device
    assert all(r[f"{dev}_tokens"] == 0 and r[f"{dev}_batch"] == 0 for dev in DEVICES)
    assert format_moe_table([r]).splitlines()[-1].endswith("| does not fit | 0 | does not fit | 0 |")


def test_qwen3_235b_fp8_on_v6e_16_fits_with_room_for_kv(tmp_path):
    """--quantization fp8 stores the stacked experts in one byte per value plus a float32 scale per expert and
    output channel: Qwen3-235B-A22B at ep 16 holds half its bfloat16 bytes per device and fits a v6e chip with a
    KV pool for 81 sequences of 4k tokens (bfloat16: 6); the report gains the table."""
    from sgl_jax.bench_sharding import quant_moe_plan

    (b16,), (f8,) = moe_plan(models=["Qwen3-235B-A22B"], ep_sizes=(16,)), quant_moe_plan(["Qwen3-235B-A22B"], (16,))
    layers, experts, hidden, inter = 94, 128, 4096, 1536
    expert_values = layers * (experts // 16) * 3 * hidden * inter
    expert_scales = layers * (experts // 16) * (2 * inter + hidden)
    assert b16["expert_bytes"] == 2 * expert_values
    assert f8["expert_bytes"] == expert_values + 4 * expert_scales
    assert 0.50 < f8["weight_bytes"] / b16["weight_bytes"] < 0.51
    assert f8["quantization"] == "fp8" and f8["v6e_batch"] == 81 and b16["v6e_batch"] == 6
    out = tmp_path / "plan.md"
    write_report(str(out), [], "python -m sgl_jax.bench_sharding", quant_rows=quant_plan(["Qwen3-32B"], (1,)),
                 quant_moe_rows=[f8])
    assert "### Mixture-of-experts models with `--quantization fp8`" in out.read_text()


def test_report_has_the_moe_table(rows, moe_rows, tmp_path):
    out = tmp_path / "plan.md"
    write_report(str(out), list(rows.values()), "python -m sgl_jax.bench_sharding --output plan.md",
                 list(moe_rows.values()))
    text = out.read_text()
    assert TABLE_HEADER in text and MOE_TABLE_HEADER in text
    assert "| Qwen3-30B-A3B | 8 | 16 of 128 | 7.15 | 6.75 | 24 |" in text
    raw = json.loads((tmp_path / "plan.json").read_text())
    assert raw["moe_rows"] == list(moe_rows.values())


def test_dispatch_bytes_match_a_simulated_routing():
    """`distinct_devices` against routings drawn at random (k distinct experts per token), and the two schemes'
    bytes: the all-gather's 2 (ep - 1) rows per token, the all-to-all's 2 d (ep - 1) / ep."""
    import numpy as np

    from sgl_jax.bench_sharding import dispatch_bytes, distinct_devices

    rng = np.random.default_rng(0)
    for e, k, ep in ((128, 8, 8), (8, 2, 8), (128, 8, 16), (64, 6, 4)):
        ids = np.argsort(rng.random((20000, e)), axis=1)[:, :k]  # k distinct experts per token
        simulated = np.mean([len(set(row)) for row in (ids // (e // ep)).tolist()])
        assert abs(distinct_devices(e, k, ep) - simulated) < 0.02 * simulated, (e, k, ep, simulated)
    assert distinct_devices(8, 2, 8) == 2.0  # Mixtral at ep 8: two experts, two devices
    b = dispatch_bytes(64, 2048, 128, 8, 8)
    assert b["allgather"] == 2 * 7 * 64 * 2048 * 2
    assert b["all_to_all"] == b["allgather"] * distinct_devices(128, 8, 8) / 8
