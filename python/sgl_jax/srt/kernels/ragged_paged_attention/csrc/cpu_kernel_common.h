// Helpers shared by the CPU attention kernels (paged_decode_cpu.cc, paged_extend_cpu.cc): bfloat16 conversion,
// reading a row as float32, and a parallel loop over XLA's intra-op thread pool.
#ifndef SGL_JAX_CPU_KERNEL_COMMON_H_
#define SGL_JAX_CPU_KERNEL_COMMON_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace sgl_jax_cpu {

namespace ffi = xla::ffi;

inline float Bf16ToF32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t F32ToBf16(float f) {  // round to nearest even, as XLA converts
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// A row of D values as float32: the row itself for float32 storage, else converted into `tmp`.
inline const float* RowF32(const void* base, bool bf16, int64_t index, int64_t D, float* tmp) {
  if (!bf16) return static_cast<const float*>(base) + index * D;
  const uint16_t* src = static_cast<const uint16_t*>(base) + index * D;
  for (int64_t d = 0; d < D; ++d) tmp[d] = Bf16ToF32(src[d]);
  return tmp;
}

// Runs fn(i) for i in [0, n) on the calling thread and up to `helpers` tasks of XLA's intra-op pool, and
// returns when every i is done. Indices are claimed from a shared counter and the caller waits for the claimed
// ones to finish, not for the helpers to start: a helper that starts late (the pool busy elsewhere, e.g. other
// virtual devices' steps) finds nothing left and returns without touching fn, so the call never waits on the pool.
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t helpers, const Fn& fn) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::mutex mu;
    std::condition_variable cv;
    int64_t done = 0;
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, n, &fn] {  // fn is read only for a claimed index, i.e. while the caller still waits
    for (int64_t i; (i = shared->next.fetch_add(1)) < n;) {
      fn(i);
      std::lock_guard<std::mutex> lock(shared->mu);
      if (++shared->done == n) shared->cv.notify_all();
    }
  };
  helpers = std::max<int64_t>(0, std::min(helpers, n - 1));
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work(); });
  work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done == n; });
}

inline bool IsF32OrBf16(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

}  // namespace sgl_jax_cpu

#endif  // SGL_JAX_CPU_KERNEL_COMMON_H_
