"""The sharding-plan benchmark (python/sgl_jax/bench_sharding.py): weight and KV bytes per device from shapes; the
generated report with its raw rows in a .json beside it."""

import json

import pytest

from sgl_jax.bench_sharding import TABLE_HEADER, plan, write_report

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
