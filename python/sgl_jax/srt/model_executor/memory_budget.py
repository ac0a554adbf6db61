"""How much device memory the KV pool gets: the KV cache's dtype and bytes per token, the budget that
--mem-fraction-static (or --max-total-tokens) leaves once the weights (LoRA slots included) are loaded, and the pool
size rounded so that restarts compile the same shapes."""

from __future__ import annotations

import logging
import os
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from sgl_jax.srt.distributed.sharding import padded_kv_heads
from sgl_jax.srt.model_loader.loader import JNP_DTYPES
from sgl_jax.srt.server_args import FP8_KV_CACHE_DTYPES

logger = logging.getLogger(__name__)


FP8_KV_DTYPES = dict(zip(FP8_KV_CACHE_DTYPES, (jnp.float8_e4m3fn, jnp.float8_e5m2)))  # --kv-cache-dtype fp8_*


def kv_cache_dtype(model_config, flag: str = "auto"):
    """The KV cache's storage dtype for ``--kv-cache-dtype`` `flag` ("auto": the model's dtype; "bf16" is
    SGLang's spelling of "bfloat16"; "fp8_e4m3" / "fp8_e5m2": float8_e4m3fn / float8_e5m2)."""
    if flag in (None, "auto"):
        return JNP_DTYPES[model_config.dtype]
    if flag in FP8_KV_DTYPES:
        return FP8_KV_DTYPES[flag]
    return JNP_DTYPES["bfloat16" if flag == "bf16" else flag]


def kv_bytes_per_token(model_config, tp_size: int = 1, kv_dtype: str = "auto") -> int:
    """Bytes of K and V per token on one device (all layers) with the KV heads split `tp_size` ways
    (replicated heads counted: see distributed/sharding.padded_kv_heads), stored as ``--kv-cache-dtype``
    `kv_dtype`."""
    itemsize = jnp.dtype(kv_cache_dtype(model_config, kv_dtype)).itemsize
    heads = padded_kv_heads(model_config.num_key_value_heads, tp_size) // tp_size
    return 2 * model_config.num_hidden_layers * heads * model_config.head_dim * itemsize


TEST_AVAILABLE_MEMORY_ENV = "SGL_JAX_TEST_AVAILABLE_MEMORY_BYTES"  # tests: pretend this much memory is free


def _device_memory_bytes() -> Optional[Tuple[int, int]]:
    """(bytes_limit, bytes_in_use) of the first local TPU/GPU from JAX's allocator, None if it reports none."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def device_kv_budget_bytes(limit: int, in_use: int, weight_bytes: int, frac: float) -> int:
    """KV bytes per TPU/GPU device: `frac` of the device's memory `limit` is for weights and the KV pool
    (SGLang's --mem-fraction-static), less what is in use once the weights are loaded (`in_use`, which holds
    them; `weight_bytes` when the allocator reports less). All in bytes."""
    return int(limit * frac) - max(in_use, weight_bytes)


def _available_memory_bytes(platform: str) -> int:
    """Free device memory on TPU/GPU; MemAvailable of the host on CPU (or $SGL_JAX_TEST_AVAILABLE_MEMORY_BYTES,
    a test hook simulating free memory that moves between restarts)."""
    if os.environ.get(TEST_AVAILABLE_MEMORY_ENV):
        return int(os.environ[TEST_AVAILABLE_MEMORY_ENV])
    if platform != "cpu":
        mem = _device_memory_bytes()
        if mem is not None:
            return mem[0] - mem[1]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot determine available memory; pass --max-total-tokens")


class NeedsWeightBytes(Exception):
    """`compute_max_total_tokens` was asked before the weights loaded (``weight_bytes`` None) where the KV budget
    is what the weights leave (TPU/GPU without --max-total-tokens): ask again once they are loaded."""


def compute_max_total_tokens(server_args, model_config, weight_bytes: Optional[int], platform: str,
                             reserve: Tuple[int, int] = (0, 0), previous: Optional[int] = None) -> int:
    """KV pool size in tokens: --max-total-tokens, or what --mem-fraction-static leaves after weights
    (`weight_bytes`: on one device; every device of the mesh holds the same share; None before they are loaded:
    enough on CPU and with --max-total-tokens, where the budget does not subtract them, else `NeedsWeightBytes`).

    Defaults for the fraction: 0.8 on TPU/GPU (of the device's memory, weights included, less what is already in
    use: `device_kv_budget_bytes`), 0.2 on CPU (of available host memory, split among the mesh's virtual
    devices, which share it). `reserve`: (weight bytes, KV bytes per token) on one device of another model whose
    K/V sits in the same slots (STANDALONE's draft model): its weights come out of the budget first and each token
    costs its K/V too.

    The budget is rounded down by `stable_pool_tokens`, and `previous` (the pool the last start with the same flags
    chose, program_cache.pool_tokens_before) is kept while the budget stays within 1/16 of it (`keeps_previous`):
    free memory moving across a rounding boundary between restarts would otherwise change the pool's shape, and
    with it every step program (measured: a restart of SmolLM2 that compiled 8 programs, 31.6 s instead of 8.8 s).
    Raises ValueError when the budget holds no KV at all, NeedsWeightBytes as said.
    """
    if server_args.max_total_tokens is not None:
        return int(server_args.max_total_tokens)
    if weight_bytes is None and platform != "cpu":
        raise NeedsWeightBytes()
    frac = server_args.mem_fraction_static or (0.2 if platform == "cpu" else 0.8)
    if platform == "cpu":  # virtual CPU devices share the host's memory: each gets its share of the budget
        budget = int(_available_memory_bytes(platform) * frac) // (server_args.tp_size * server_args.dp_size)
    else:
        mem = None if os.environ.get(TEST_AVAILABLE_MEMORY_ENV) else _device_memory_bytes()
        if mem is not None:
            budget = device_kv_budget_bytes(*mem, weight_bytes, frac)
        else:  # no allocator statistics: the fraction of what is free (host memory, or the test hook)
            budget = int(_available_memory_bytes(platform) * frac) - weight_bytes
    per_token = kv_bytes_per_token(model_config, server_args.tp_size, server_args.kv_cache_dtype) + reserve[1]
    tokens = (budget - reserve[0]) // per_token
    if tokens <= 0:
        raise ValueError("--mem-fraction-static leaves no memory for the KV cache; raise it or pass "
                         "--max-total-tokens")
    if previous is not None and keeps_previous(previous, int(tokens), server_args.page_size, platform):
        logger.info("KV pool auto-sized to %d tokens, as the last start with these flags (the budget of %d tokens "
                    "is within 1/16 of it; --max-total-tokens sets it exactly)", previous, tokens)
        return previous
    stable = stable_pool_tokens(int(tokens), server_args.page_size)
    logger.info("KV pool auto-sized to %d tokens (the budget of %d tokens rounded down to 4 significant bits, "
                "so that a restart compiles the same shapes; --max-total-tokens sets it exactly)", stable, tokens)
    return stable


def keeps_previous(previous: int, tokens: int, page_size: int, platform: str) -> bool:
    """Whether an auto-sized pool keeps `previous` tokens (the last start's) for a budget of `tokens`: whole pages,
    within 1/16 of the budget, and on TPU/GPU (whose memory the pool must fit) not above it. On CPU it may exceed
    the budget by that much: the budget is a fraction (0.2) of the host's available memory, which moves with the
    page cache between starts."""
    return (previous > 0 and previous % page_size == 0 and abs(tokens - previous) * 16 <= previous
            and (platform == "cpu" or previous <= tokens))


def stable_pool_tokens(tokens: int, page_size: int) -> int:
    """`tokens` rounded down to its 4 leading binary digits (a multiple of 2**(bit_length - 4): 8 sizes per
    power of two, losing at most a ninth) and to whole pages, so the auto-sized pool, which follows free
    memory, keeps one size (and so one set of compiled programs: the pool's shape is in every step program)
    across restarts of a server. Returns at least one page.
    """
    granule = max(page_size, 1 << max(0, tokens.bit_length() - 4))
    granule = -(-granule // page_size) * page_size
    return max(page_size, tokens // granule * granule)
