// A buffer XLA's CPU backend allocates and nothing writes: the custom call's body is empty, so the result is the
// memory XLA's allocator handed out, untouched. Called through JAX's FFI (jax.ffi.ffi_call) by
// model_executor/kv_allocation.py for the paged KV pool's buffers.
//
// Why: zeroing SmolLM2's default KV pool (4.2 GiB, 60 buffers) is a memset of every byte, 1.4 s on a 2-core CPU
// alone and ~4 s beside a restart's other work, on start-up's critical path. A buffer far above glibc's largest
// mmap threshold (32 MiB on 64-bit) is a fresh anonymous mapping, whose pages the kernel supplies zeroed on first
// touch, so the pool is zero without a memset and its pages are paid for as serving first writes them. Smaller
// buffers may be recycled heap memory holding old bytes: the caller zeroes those (kv_allocation.FRESH_MIN_BYTES).
//
// Result: one buffer of any shape and dtype (the ffi_call's result type). No operands, no attributes.

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error FreshBufferImpl(ffi::Result<ffi::AnyBuffer> out) {
  (void)out;  // left as allocated
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SglJaxFreshBuffer, FreshBufferImpl, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());
