"""Choosing the ragged paged attention implementation ("native" or "pallas"; the ``--attention-backend`` flag's
"auto" is resolved to one of them by `server_args.resolve_attention_backend`).

- native: the pure-JAX implementation (`ref`), which XLA compiles for any device; on CPU its decode batches and
  its extend batches (prefill, mixed, speculative verify) run the C++ kernels of `cpu` instead (built at
  install; `ref` where they are missing or switched off: SGL_JAX_CPU_DECODE_KERNEL=0 turns both off,
  SGL_JAX_CPU_EXTEND_KERNEL=0 the extend one).
- pallas: the Pallas kernel of the platform: Mosaic TPU (`tpu`) on TPU, Triton (`gpu`) on GPU; on CPU the
  TPU kernel in Pallas' interpreter (slow; for verifying the kernel end to end, not for serving).

Every implementation has the signature and contract of `ref.ragged_paged_attention`, so the model code
calls `ragged_paged_attention(..., backend=...)` and does not know which one runs.
"""

from __future__ import annotations

from typing import Optional

import jax

from sgl_jax.srt.kernels.ragged_paged_attention import cpu, ref

IMPLEMENTATIONS = ("native", "pallas")


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale: float,
                           sliding_window: Optional[int] = None, soft_cap: Optional[float] = None,
                           decode_only: bool = False, prefix_lens=None, segment_starts=None,
                           shared_prefix_len=None, tree_bits=None, backend: str = "native"):
    """Ragged paged attention by the chosen backend ("native" or "pallas"; see `ref.ragged_paged_attention`
    for the arguments, shapes and result). The platform is the default JAX backend at trace time."""
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, decode_only=decode_only,
                  prefix_lens=prefix_lens, segment_starts=segment_starts, tree_bits=tree_bits)
    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if backend == "native":
        if decode_only and _cpu_decode_kernel(q.dtype, k_pages.dtype):
            return cpu.decode_attention(q, k_pages, v_pages, kv_lens, page_indices, num_seqs, sm_scale=sm_scale,
                                        sliding_window=sliding_window, soft_cap=soft_cap)
        if not decode_only and _cpu_extend_kernel(q.dtype, k_pages.dtype):
            return cpu.extend_attention(*args, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                        prefix_lens=prefix_lens, segment_starts=segment_starts, tree_bits=tree_bits)
        return ref.ragged_paged_attention(*args, shared_prefix_len=shared_prefix_len, **kwargs)
    if backend not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention backend {backend!r} (expected one of {list(IMPLEMENTATIONS)})")
    platform = jax.default_backend()
    if platform in ("gpu", "cuda", "rocm"):
        from sgl_jax.srt.kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu

        return ragged_paged_attention_gpu(*args, **kwargs)
    from sgl_jax.srt.kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu

    return ragged_paged_attention_tpu(*args, interpret=platform != "tpu", **kwargs)


def _cpu_decode_kernel(q_dtype, kv_dtype) -> bool:
    """Whether a native decode call traced now runs `cpu.decode_attention`: the platform is CPU, the kernel is
    built and not switched off, and it takes these dtypes."""
    return jax.default_backend() == "cpu" and cpu.supports(q_dtype, kv_dtype) and cpu.enabled()


def _cpu_extend_kernel(q_dtype, kv_dtype) -> bool:
    """Whether a native extend call traced now runs `cpu.extend_attention` (as `_cpu_decode_kernel`, with the
    extend kernel's own switch)."""
    return jax.default_backend() == "cpu" and cpu.supports(q_dtype, kv_dtype) and cpu.extend_enabled()


def register_kernels() -> None:
    """Register this platform's custom-call kernels with XLA now (on CPU, the C++ kernels, where built and not
    switched off; elsewhere nothing: Pallas kernels need no registration). A serialized executable that calls a
    kernel loads only once it is registered (program_cache.start_prefetch)."""
    if jax.default_backend() == "cpu":
        cpu.enabled()
        cpu.extend_enabled()


def describe(backend: str) -> str:
    """The backend as reports and logs name it, e.g. "native (decode: C++ CPU kernel, extend: C++ CPU kernel)" on
    CPU with the kernels built, "native (decode: pure JAX, extend: pure JAX)" without them."""
    if backend != "native" or jax.default_backend() != "cpu":
        return backend
    name = lambda on: "C++ CPU kernel" if on else "pure JAX"  # noqa: E731
    return f"native (decode: {name(cpu.enabled())}, extend: {name(cpu.extend_enabled())})"
