// The decode kernel's inner loops, included by paged_decode_cpu.cc once per instruction set (a namespace each:
// baseline, and on x86-64 AVX2 + FMA, picked at run time). Needs Problem, Partial, kChunk and RowF32 in scope.

#include "fast_exp.h"

// sum(a[d] * b[d]) over d < D, as four independent partial sums (one dependency chain of fused multiply-adds
// per quarter instead of one for the whole row: the chain's latency, not the arithmetic, bounded the kernel).
inline float Dot(const float* __restrict a, const float* __restrict b, int64_t D) {
  if (D % 4 != 0) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
    return s;
  }
  const int64_t Q = D / 4;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t d = 0; d < Q; ++d) {
    s0 += a[d] * b[d];
    s1 += a[d + Q] * b[d + Q];
    s2 += a[d + 2 * Q] * b[d + 2 * Q];
    s3 += a[d + 3 * Q] * b[d + 3 * Q];
  }
  return (s0 + s1) + (s2 + s3);
}

// Scores of one token's K row kr [KVH * D] against every query head: out[hq * stride] = q[hq] . k[hq / G]. With
// AVX2 (this header's AVX2 copy) and D a multiple of 8, eight heads at a time: eight vector partial sums, reduced
// together by a tree of horizontal adds (7 instructions for 8 sums, where reducing each alone takes ~4 each).
inline void ScoreRow(const float* __restrict q, const float* __restrict kr, int64_t H, int64_t G, int64_t D,
                     float* __restrict out, int64_t stride) {
  int64_t hq = 0;
#ifdef SGL_JAX_CORE_AVX2
  if (D % 8 == 0) {
    for (; hq + 8 <= H; hq += 8) {
      __m256 a[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        for (int i = 0; i < 8; ++i) {
          const __m256 kv = _mm256_loadu_ps(kr + ((hq + i) / G) * D + d);
          a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (hq + i) * D + d), kv, a[i]);
        }
      }
      const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
      const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
      const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
      const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                        _mm256_permute2f128_ps(s0123, s4567, 0x31));
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, sums);
      for (int i = 0; i < 8; ++i) out[(hq + i) * stride] = tmp[i];
    }
  }
#endif
  for (; hq < H; ++hq) out[hq * stride] = Dot(q + hq * D, kr + (hq / G) * D, D);
}

inline void PrefetchRow(const void* base, int64_t byte_offset, int64_t bytes) {
  const char* ptr = static_cast<const char*>(base) + byte_offset;
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(ptr + b);
}

// Keys [lo, hi) of sequence s against all its query heads, a chunk of kChunk tokens at a time. A token's K (then
// V) row holds every KV head (KVH * D values, contiguous), and all of it is used at once: every query head is
// scored against the K row, then every head's accumulator takes the V row. While row j of a chunk is used, row j
// of the next chunk is prefetched. Spread out so, one SmolLM2 layer at 64 x 1,500 tokens went from 31 to 19 ms
// at page 1 and from 14.5 to 11 ms at page 16; a burst of the whole next chunk stalled on the prefetches
// themselves. (Head-major order, each head's accumulator in registers over the chunk, measured 2x slower.)
// DK is the head dimension when it is known at compile time (the common ones: the loops over it then vectorize
// fully), else 0 and D is read at run time. The online-softmax state goes to out (m, l [H], acc [H, D]).
template <int DK>
void AttendRangeT(const Problem& p, int64_t s, int64_t lo, int64_t hi, Partial& out) {
  const int64_t H = p.H, G = p.G, KVH = p.KVH, D = DK > 0 ? DK : p.D;
  const int64_t row_elems = KVH * D, row_bytes = row_elems * (p.kv_bf16 ? 2 : 4);
  std::vector<float> qbuf(H * D), sbuf(H * kChunk), kbuf(row_elems), vbuf(row_elems);
  out.m.assign(H, -INFINITY);
  out.l.assign(H, 0.f);
  out.acc.assign(H * D, 0.f);
  float* __restrict qv = qbuf.data();
  float* __restrict scores = sbuf.data();
  float* __restrict acc = out.acc.data();
  {
    const float* row = RowF32(p.q, p.q_bf16, s, H * D, qv);
    for (int64_t i = 0; i < H * D; ++i) qv[i] = row[i] * p.sm_scale;
  }
  const int32_t* table = p.pages + s * p.P;
  auto token_row = [&](int64_t t) {
    return static_cast<int64_t>(table[t / p.page_size]) * p.page_size + t % p.page_size;
  };
  int64_t rows[kChunk], next[kChunk];
  for (int j = 0; j < kChunk && lo + j < hi; ++j) next[j] = token_row(lo + j);
  for (int64_t start = lo; start < hi; start += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, hi - start));
    const int n_next = static_cast<int>(std::clamp<int64_t>(hi - start - kChunk, 0, kChunk));
    for (int j = 0; j < n; ++j) rows[j] = next[j];
    for (int j = 0; j < n_next; ++j) next[j] = token_row(start + kChunk + j);
    for (int j = 0; j < n; ++j) {
      if (j < n_next) PrefetchRow(p.k, next[j] * row_bytes, row_bytes);
      const float* __restrict kr = RowF32(p.k, p.kv_bf16, rows[j], row_elems, kbuf.data());
      ScoreRow(qv, kr, H, G, D, scores + j, kChunk);
    }
    for (int64_t hq = 0; hq < H; ++hq) {
      float* __restrict sh = scores + hq * kChunk;
      if (p.soft_cap > 0.f)
        for (int j = 0; j < n; ++j) sh[j] = p.soft_cap * std::tanh(sh[j] / p.soft_cap);
      float mx = out.m[hq];
      for (int j = 0; j < n; ++j) mx = std::max(mx, sh[j]);
      const float corr = FastExp(out.m[hq] - mx);  // exp(-inf) = 0 on the first chunk
      float sum = 0.f;
      for (int j = 0; j < n; ++j) {
        sh[j] = FastExp(sh[j] - mx);
        sum += sh[j];
      }
      out.l[hq] = out.l[hq] * corr + sum;
      out.m[hq] = mx;
      float* __restrict ah = acc + hq * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ah[d] *= corr;
    }
    for (int j = 0; j < n; ++j) {
      if (j < n_next) PrefetchRow(p.v, next[j] * row_bytes, row_bytes);
      const float* __restrict vr = RowF32(p.v, p.kv_bf16, rows[j], row_elems, vbuf.data());
      for (int64_t hq = 0; hq < H; ++hq) {
        const float w = scores[hq * kChunk + j];
        const float* __restrict vh = vr + (hq / G) * D;
        float* __restrict ah = acc + hq * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ah[d] += w * vh[d];
      }
    }
  }
}

void AttendRangeIsa(const Problem& p, int64_t s, int64_t lo, int64_t hi, Partial& out) {
  switch (p.D) {
    case 64: return AttendRangeT<64>(p, s, lo, hi, out);
    case 128: return AttendRangeT<128>(p, s, lo, hi, out);
    case 256: return AttendRangeT<256>(p, s, lo, hi, out);
    default: return AttendRangeT<0>(p, s, lo, hi, out);
  }
}

