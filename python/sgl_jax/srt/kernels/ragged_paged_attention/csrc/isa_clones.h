// Compiles the core header named by SGL_JAX_CORE_HEADER twice: into namespace `baseline`, and on x86-64 with GCC
// into namespace `avx2` with AVX2 + FMA enabled (SGL_JAX_CORE_AVX2 defined there, for the intrinsics paths). A
// kernel picks one at run time with CpuHasAvx2Fma(). Include it inside the kernel's own namespace, after what the
// core header needs; it may be included once per translation unit. Calls read
// `CpuHasAvx2Fma() ? avx2::F(...) : baseline::F(...)`.

namespace baseline {
#include SGL_JAX_CORE_HEADER
}  // namespace baseline

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SGL_JAX_HAVE_AVX2_CLONE 1
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define SGL_JAX_CORE_AVX2 1
namespace avx2 {
#include SGL_JAX_CORE_HEADER
}  // namespace avx2
#undef SGL_JAX_CORE_AVX2
#pragma GCC pop_options
#else
namespace avx2 = baseline;  // no clone: CpuHasAvx2Fma() is false, and this name only keeps callers uniform
#endif

// Whether the AVX2 + FMA clone exists and this CPU runs it.
inline bool CpuHasAvx2Fma() {
#ifdef SGL_JAX_HAVE_AVX2_CLONE
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
#else
  return false;
#endif
}
