"""The host-memory KV pool of one DP rank and the copies between it and the device KV buffers: the `KVMover` that
HiRadixCache (mem_cache/hi_radix_cache.py, --enable-hierarchical-cache) calls when it writes an evicted prefix's
KV to the host and loads it back.

The host pool holds every layer's K and V of ``tokens`` token slots as numpy arrays, [layers, tokens, kv_heads,
head_dim] each, in the KV cache's dtype and head layout (tensor-parallel padded heads included), so a copy back is
bit-exact. A copy runs as one of a few compiled programs (`HostKVCopies`), each moving a fixed number of token
slots per rank (HOST_COPY_SIZES; a larger move runs in pieces of the largest, a smaller one is padded with the
rank's padding slot 0), so serving compiles nothing new. Device -> host gathers the slots of every layer and
reads them back (it waits for the steps launched before it); host -> device scatters them into the donated KV
buffers, after the steps launched before it and before any launched after.

Source: SGLang's HiCache (python/sglang/srt/mem_cache/memory_pool_host.py keeps a host pool in the device pool's
layout and copies pages of every layer between them).
"""

from __future__ import annotations

import functools
import logging
from typing import List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sgl_jax.srt.distributed.sharding import KV_CACHE, RANK_ROWS
from sgl_jax.srt.kernels.ragged_paged_attention.ref import write_kv_to_pages

logger = logging.getLogger(__name__)

HOST_COPY_SIZES = (128, 512, 2048)  # token slots per rank that one compiled copy program moves
LAYER_ROWS = P(None, "data", "tensor", None)  # [layers, dp * M, kv_heads, head_dim]: rank r's rows, its heads split
GB = 10**9
MB = 10**6


def _gather_local(kv, src):
    """Every layer's K and V at rank-local slots `src` (int32[M]): two [layers, M, kv_heads, head_dim] arrays."""
    ps = kv[0][0].shape[1]
    page, offset = src // ps, src % ps
    return (jnp.stack([k[page, offset] for k, _ in kv]), jnp.stack([v[page, offset] for _, v in kv]))


def _scatter_local(kv, dst, k, v):
    """`kv` with layer l's K and V at rank-local slots `dst` (int32[M]) set to k[l], v[l]."""
    return [write_kv_to_pages(kp, vp, k[i], v[i], dst) for i, (kp, vp) in enumerate(kv)]


def gather_slots(kv_caches: list, src: jax.Array, mesh) -> Tuple[jax.Array, jax.Array]:
    """Read K/V slots of every layer, every rank at once.

    Args:
        kv_caches: per layer (k_pages, v_pages), [dp * pages, page_size, kv_heads, head_dim] (sharded KV_CACHE).
        src: int32[dp * M]: rank r's slots (local to its KV block) at rows [r * M, (r + 1) * M).
        mesh: the device mesh (ranks over ``data``, heads over ``tensor``).
    Returns:
        (k, v), [layers, dp * M, kv_heads, head_dim] each, in the cache's dtype.
    """
    specs = [(KV_CACHE, KV_CACHE)] * len(kv_caches)
    return jax.shard_map(_gather_local, mesh=mesh, in_specs=(specs, RANK_ROWS), out_specs=(LAYER_ROWS, LAYER_ROWS),
                         check_vma=False)(kv_caches, src)


def scatter_slots(kv_caches: list, dst: jax.Array, k: jax.Array, v: jax.Array, mesh) -> list:
    """Write K/V slots of every layer (the inverse of `gather_slots`; same shapes). Padding rows write the padding
    slot 0, which nothing reads. Returns the updated caches (the caller's jit donates them)."""
    specs = [(KV_CACHE, KV_CACHE)] * len(kv_caches)
    return jax.shard_map(_scatter_local, mesh=mesh, in_specs=(specs, RANK_ROWS, LAYER_ROWS, LAYER_ROWS),
                         out_specs=specs, check_vma=False)(kv_caches, dst, k, v)


class HostKVCopies:
    """The compiled copy programs of one model runner, shared by its ranks' host pools.

    Args:
        mesh: the runner's mesh; kv_sharding: its KV buffers' sharding; dp_size: DP ranks.
        num_layers, kv_heads, head_dim, dtype: the KV buffers' layout (kv_heads: all of them, tensor-parallel
            padding included).
    """

    def __init__(self, mesh, kv_sharding, dp_size: int, num_layers: int, kv_heads: int, head_dim: int, dtype):
        self.dp_size, self.num_layers = dp_size, num_layers
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, np.dtype(dtype)
        rows = NamedSharding(mesh, LAYER_ROWS)
        self._gather = jax.jit(functools.partial(gather_slots, mesh=mesh), out_shardings=(rows, rows))
        self._scatter = jax.jit(functools.partial(scatter_slots, mesh=mesh), donate_argnums=(0,),
                                out_shardings=kv_sharding)

    def _rows(self, m: int) -> np.ndarray:
        return np.zeros((self.num_layers, self.dp_size * m, self.kv_heads, self.head_dim), self.dtype)

    def warmup_programs(self, kv_caches_fn) -> list:
        """(name, thunk lowering it) of each copy program, with serving's exact argument types; `kv_caches_fn`
        returns the runner's current KV buffers."""
        out = []
        for m in HOST_COPY_SIZES:
            idx = np.zeros(self.dp_size * m, np.int32)
            out.append((f"host KV read M={m}", lambda idx=idx: self._gather.lower(kv_caches_fn(), idx)))
            out.append((f"host KV write M={m}", lambda idx=idx, m=m: self._scatter.lower(
                kv_caches_fn(), idx, self._rows(m), self._rows(m))))
        return out

    @staticmethod
    def pieces(n: int) -> List[Tuple[int, int, int]]:
        """(start, length, program size) of the pieces a copy of n slots runs in."""
        out, start, big = [], 0, HOST_COPY_SIZES[-1]
        while start < n:
            length = min(big, n - start)
            out.append((start, length, next(m for m in HOST_COPY_SIZES if m >= length)))
            start += length
        return out

    def read(self, kv_caches: list, rank: int, slots: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """K and V of rank `rank`'s device slots (int32[n]): numpy [layers, n, kv_heads, head_dim] each."""
        ks, vs = [], []
        for start, n, m in self.pieces(len(slots)):
            idx = np.zeros(self.dp_size * m, np.int32)
            idx[rank * m:rank * m + n] = slots[start:start + n]
            k, v = self._gather(kv_caches, idx)
            ks.append(np.asarray(k)[:, rank * m:rank * m + n])
            vs.append(np.asarray(v)[:, rank * m:rank * m + n])
        return np.concatenate(ks, axis=1), np.concatenate(vs, axis=1)

    def write(self, kv_caches: list, rank: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> list:
        """`kv_caches` (donated) with rank `rank`'s device slots (int32[n]) set to k, v ([layers, n, kv_heads,
        head_dim] each); returns the new buffers."""
        for start, n, m in self.pieces(len(slots)):
            idx = np.zeros(self.dp_size * m, np.int32)
            idx[rank * m:rank * m + n] = slots[start:start + n]
            kr, vr = self._rows(m), self._rows(m)
            kr[:, rank * m:rank * m + n] = k[:, start:start + n]
            vr[:, rank * m:rank * m + n] = v[:, start:start + n]
            kv_caches = self._scatter(kv_caches, idx, kr, vr)
        return kv_caches


class HostKVPool:
    """One rank's host KV pool (the `KVMover` of hi_radix_cache.py): ``tokens`` host slots of every layer's K and
    V, and the copies to and from the rank's device slots through the runner (`ModelRunner.read_kv_slots` /
    `write_kv_slots`). Host memory is taken as slots are first written (numpy's zeroed pages).

    Args:
        runner: the `ModelRunner` (its KV buffers and copy programs).
        rank: the DP rank whose block of the KV buffers this pool mirrors.
        tokens: host slots.
    """

    def __init__(self, runner, rank: int, tokens: int):
        copies = runner.host_kv_copies
        self.runner, self.rank, self.tokens = runner, rank, tokens
        shape = (copies.num_layers, tokens, copies.kv_heads, copies.head_dim)
        self.k = np.zeros(shape, copies.dtype)
        self.v = np.zeros(shape, copies.dtype)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def to_host(self, device_slots: np.ndarray, host_slots: np.ndarray) -> None:
        k, v = self.runner.read_kv_slots(self.rank, np.asarray(device_slots, np.int32))
        self.k[:, host_slots], self.v[:, host_slots] = k, v

    def to_device(self, host_slots: np.ndarray, device_slots: np.ndarray) -> None:
        self.runner.write_kv_slots(self.rank, np.asarray(device_slots, np.int32), self.k[:, host_slots],
                                   self.v[:, host_slots])


def host_pool_tokens(server_args, device_tokens: int, bytes_per_token: int, page_size: int,
                     available_bytes: Optional[int] = None) -> int:
    """Host slots of one rank: --hicache-size GB of K and V (when > 0) else --hicache-ratio x the device pool's
    tokens, rounded down to whole pages (SGLang's rule: the size wins over the ratio).

    Args:
        device_tokens: the rank's device pool (tokens); bytes_per_token: K and V of every layer, all heads.
        available_bytes: host memory the pools of all ranks may take (None: not checked).
    Raises:
        ValueError: less than a page, or more than `available_bytes` over the DP ranks (names the flags).
    """
    if server_args.hicache_size > 0:
        tokens = int(server_args.hicache_size * GB) // bytes_per_token
        how = f"--hicache-size {server_args.hicache_size} GB"
    else:
        tokens = int(server_args.hicache_ratio * device_tokens)
        how = f"--hicache-ratio {server_args.hicache_ratio} x {device_tokens} device tokens"
    tokens = tokens // page_size * page_size
    if tokens < page_size:
        raise ValueError(f"the host KV pool ({how}) holds less than one page of {page_size} tokens")
    need = tokens * bytes_per_token * server_args.dp_size
    if available_bytes is not None and need > available_bytes:
        raise ValueError(f"the host KV pool ({how}: {need / GB:.2f} GB over {server_args.dp_size} rank(s)) exceeds "
                         f"the {available_bytes / GB:.2f} GB of host memory available: lower --hicache-ratio or "
                         f"--hicache-size")
    return tokens


def available_host_bytes() -> Optional[int]:
    """MemAvailable of /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
