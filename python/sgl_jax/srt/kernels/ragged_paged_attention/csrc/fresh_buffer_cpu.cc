// A zeroed buffer for XLA's CPU backend without writing its pages: the whole pages of the buffer XLA's allocator
// handed out are given back to the kernel (madvise MADV_DONTNEED), whose anonymous private memory then reads as
// zero and is zero-filled page by page on first touch; the partial pages at either end are memset. Called through
// JAX's FFI (jax.ffi.ffi_call) by model_executor/kv_allocation.py for the paged KV pool's buffers.
//
// Why: zeroing SmolLM2's default KV pool (4.2 GiB, 60 buffers) was a memset of every byte, 1.4 s on a 2-core CPU
// alone and more beside a restart's other work, on start-up's critical path. A fresh mapping's untouched pages
// cost nothing to give back; memory the allocator recycled (it may hold an earlier buffer's bytes) is released
// and reads as zero just the same (Linux madvise(2): "zero-fill-on-demand pages for anonymous private mappings").
// Where madvise fails, the whole buffer is memset.
//
// Result: one buffer of any shape and dtype (the ffi_call's result type). Attribute: zero (bool); false leaves the
// buffer as allocated (tests only: it shows that the allocator's memory can hold old bytes).

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error FreshBufferImpl(ffi::Result<ffi::AnyBuffer> out, bool zero) {
  if (!zero) return ffi::Error::Success();
  char* data = static_cast<char*>(out->untyped_data());
  const size_t size = out->size_bytes();
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t first = (begin + page - 1) & ~(page - 1);  // the first whole page
  const uintptr_t last = (begin + size) & ~(page - 1);       // the end of the last whole page
  if (last <= first || madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED) != 0) {
    std::memset(data, 0, size);
    return ffi::Error::Success();
  }
  std::memset(data, 0, first - begin);
  std::memset(reinterpret_cast<void*>(last), 0, begin + size - last);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(SglJaxFreshBuffer, FreshBufferImpl,
                              ffi::Ffi::Bind().Ret<ffi::AnyBuffer>().Attr<bool>("zero"));
