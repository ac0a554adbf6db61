// The extend kernel's inner loops, included by paged_extend_cpu.cc once per instruction set (a namespace each:
// baseline, and on x86-64 AVX2 + FMA, picked at run time). Needs ExtendProblem, Item, kBlockQ, kBlockK, kNoTree,
// RowF32 and F32ToBf16 in scope.

#include "fast_exp.h"

#ifdef SGL_JAX_CORE_AVX2
// One register tile of C[MR rows][8 * NV columns] (+)= A[MR][K] . B[K][8 * NV]: MR x NV accumulators, each A
// element broadcast once per k (the GEMM micro-kernel of Goto & van de Geijn 2008; 6 x 16 fills 12 of AVX2's 16
// vector registers).
template <int MR, int NV>
inline void Tile(int64_t K, const float* __restrict A, int64_t lda, const float* __restrict B, int64_t ldb,
                 float* __restrict C, int64_t ldc, bool accumulate) {
  __m256 c[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) c[i][v] = accumulate ? _mm256_loadu_ps(C + i * ldc + 8 * v) : _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm256_loadu_ps(B + k * ldb + 8 * v);
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(A + i * lda + k);
      for (int v = 0; v < NV; ++v) c[i][v] = _mm256_fmadd_ps(a, b[v], c[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(C + i * ldc + 8 * v, c[i][v]);
}

template <int NV>
inline void Rows(int64_t M, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                 int64_t ldc, bool accumulate) {
  int64_t i = 0;
  for (; i + 6 <= M; i += 6) Tile<6, NV>(K, A + i * lda, lda, B, ldb, C + i * ldc, ldc, accumulate);
  const float* a = A + i * lda;
  float* c = C + i * ldc;
  switch (M - i) {
    case 5: return Tile<5, NV>(K, a, lda, B, ldb, c, ldc, accumulate);
    case 4: return Tile<4, NV>(K, a, lda, B, ldb, c, ldc, accumulate);
    case 3: return Tile<3, NV>(K, a, lda, B, ldb, c, ldc, accumulate);
    case 2: return Tile<2, NV>(K, a, lda, B, ldb, c, ldc, accumulate);
    case 1: return Tile<1, NV>(K, a, lda, B, ldb, c, ldc, accumulate);
    default: return;
  }
}
#endif

#ifdef SGL_JAX_CORE_AVX2
// FastExp on eight lanes (the same polynomial and clamp, so both builds give the same values up to FMA rounding).
inline __m256 FastExp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 fi = _mm256_floor_ps(t);
  const __m256 f = _mm256_sub_ps(t, fi);
  __m256 p = _mm256_set1_ps(0.00021683432f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.00124379469f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.00967998523f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.05548214912f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.24023030698f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.69314688444f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fi), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float HorizontalSum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}
#endif

// max(x[j]) over j < n (-inf when n is 0).
inline float RowMax(const float* __restrict x, int64_t n) {
  float mx = -INFINITY;
  int64_t j = 0;
#ifdef SGL_JAX_CORE_AVX2
  __m256 v = _mm256_set1_ps(-INFINITY);
  for (; j + 8 <= n; j += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + j));
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  a = _mm_max_ss(a, _mm_movehdup_ps(a));
  mx = _mm_cvtss_f32(a);
#endif
  for (; j < n; ++j) mx = std::max(mx, x[j]);
  return mx;
}

// x[j] = exp(x[j] - mx), exactly 0 where x[j] is -inf (a hidden key adds nothing); returns the sum.
inline float ExpRow(float* __restrict x, int64_t n, float mx) {
  float sum = 0.f;
  int64_t j = 0;
#ifdef SGL_JAX_CORE_AVX2
  const __m256 vmx = _mm256_set1_ps(mx), ninf = _mm256_set1_ps(-INFINITY);
  __m256 vsum = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    const __m256 e = _mm256_and_ps(FastExp8(_mm256_sub_ps(v, vmx)), _mm256_cmp_ps(v, ninf, _CMP_GT_OQ));
    _mm256_storeu_ps(x + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  sum = HorizontalSum(vsum);
#endif
  for (; j < n; ++j) {
    const float v = x[j];
    x[j] = v > -INFINITY ? FastExp(v - mx) : 0.f;
    sum += x[j];
  }
  return sum;
}

// C[i][j] (+)= sum_k A[i][k] * B[k][j] for i < M, j < N (row strides lda, ldb, ldc; `accumulate` false: C is
// overwritten). With AVX2, register tiles of 16 and 8 columns; the remaining columns and the baseline build in
// plain loops that the compiler vectorizes over j.
inline void Gemm(int64_t M, int64_t N, int64_t K, const float* __restrict A, int64_t lda, const float* __restrict B,
                 int64_t ldb, float* __restrict C, int64_t ldc, bool accumulate) {
  int64_t j = 0;
#ifdef SGL_JAX_CORE_AVX2
  for (; j + 16 <= N; j += 16) Rows<2>(M, K, A, lda, B + j, ldb, C + j, ldc, accumulate);
  for (; j + 8 <= N; j += 8) Rows<1>(M, K, A, lda, B + j, ldb, C + j, ldc, accumulate);
#endif
  if (j == N) return;
  for (int64_t i = 0; i < M; ++i) {
    float* __restrict c = C + i * ldc;
    if (!accumulate)
      for (int64_t jj = j; jj < N; ++jj) c[jj] = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const float a = A[i * lda + k];
      const float* __restrict b = B + k * ldb;
#pragma omp simd
      for (int64_t jj = j; jj < N; ++jj) c[jj] += a * b[jj];
    }
  }
}

// What the rows of one work item see: row r (query position qpos = base + r0 + r) sees key k when
// lo[r] <= k < hi[r], (k < prefix or k >= seg[r]) and, for a draft-tree row, k < base or bit (k - base) of its
// tree bits is set (`ref.ragged_paged_attention`'s mask, term by term).
struct RowMasks {
  int64_t base, prefix, max_slots;
  std::vector<int64_t> lo, hi, seg;
  std::vector<int32_t> tree;

  bool Visible(int64_t r, int64_t k) const {
    if (k < lo[r] || k >= hi[r] || (k >= prefix && k < seg[r])) return false;
    if (tree[r] == kNoTree || k < base) return true;
    const int64_t rel = std::min<int64_t>(k - base, max_slots - 1);
    return ((tree[r] >> rel) & 1) != 0;
  }
  // Sets the scores of the keys [k0, k0 + nk) that row r does not see to -inf: two key ranges (the prefix part
  // and the segment part, in a loop the compiler vectorizes), then the tree term key by key for a draft-tree row.
  void Apply(int64_t r, int64_t k0, int64_t nk, float* __restrict scores) const {
    const int64_t a1 = lo[r] - k0, b1 = std::min(hi[r], prefix) - k0;
    const int64_t a2 = std::max({lo[r], seg[r], prefix}) - k0, b2 = hi[r] - k0;
#pragma omp simd
    for (int64_t j = 0; j < nk; ++j) {
      const bool seen = (j >= a1 && j < b1) || (j >= a2 && j < b2);
      scores[j] = seen ? scores[j] : -INFINITY;
    }
    if (tree[r] == kNoTree) return;
    for (int64_t j = std::max<int64_t>(0, base - k0); j < nk; ++j)
      if (!Visible(r, k0 + j)) scores[j] = -INFINITY;
  }
  // Keys of [k0, k1) that row r sees, not counting the tree term.
  int64_t Count(int64_t r, int64_t k0, int64_t k1) const {
    const int64_t a = std::max(lo[r], k0), b = std::min(hi[r], k1);
    if (b <= a) return 0;
    return std::max<int64_t>(0, std::min(b, prefix) - a) + std::max<int64_t>(0, b - std::max({a, seg[r], prefix}));
  }
};

// One work item: rows [r0, r0 + rows) of sequence s against its keys, for the G query heads of KV head kh, in
// blocks of kBlockK keys (FlashAttention's online softmax, Dao et al. 2022). Scores and the value product are
// register-tiled matmuls over the item's rows x G heads; key blocks no row sees are skipped, and the masking
// pass runs only on blocks that some row sees in part. A row's result depends on its own keys alone (a block it
// sees nothing of leaves its state exactly as it was), so it is the same in any batch.
void AttendItemIsa(const ExtendProblem& p, const Item& it) {
  const int64_t D = p.D, G = p.G, H = p.H, KVH = p.KVH, BK = kBlockK;
  const int64_t n = it.rows, R = n * G;
  const int64_t kv_len = std::clamp<int64_t>(p.kv_lens[it.s], 0, p.P * p.page_size);
  RowMasks mk;
  mk.base = kv_len - it.q_len;
  mk.prefix = p.prefix_lens[it.s];
  mk.max_slots = p.max_tree_slots;
  mk.lo.resize(n);
  mk.hi.resize(n);
  mk.seg.resize(n);
  mk.tree.resize(n);
  int64_t kmin = INT64_MAX, kmax = 0;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = it.q_start + it.r0 + r, qpos = mk.base + it.r0 + r;
    mk.hi[r] = std::clamp<int64_t>(qpos + 1, 0, kv_len);
    mk.lo[r] = p.window > 0 ? std::clamp<int64_t>(qpos - p.window + 1, 0, mk.hi[r]) : 0;
    mk.seg[r] = p.seg_starts[t];
    mk.tree[r] = p.tree_bits[t];
    if (mk.hi[r] > mk.lo[r]) {
      kmin = std::min(kmin, mk.lo[r]);
      kmax = std::max(kmax, mk.hi[r]);
    }
  }
  std::vector<float> x(R * D), s(R * BK), kt(D * BK), vb(BK * D), acc(R * D, 0.f), pv(R * D), m(R, -INFINITY),
      l(R, 0.f), scale(R), tmp(D);
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = it.q_start + it.r0 + r;
    for (int64_t g = 0; g < G; ++g) {
      const float* src = RowF32(p.q, p.q_bf16, t * H + it.kh * G + g, D, tmp.data());
      float* dst = x.data() + (r * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * p.sm_scale;
    }
  }
  const int32_t* table = p.pages + it.s * p.P;
  for (int64_t k0 = kmax > kmin ? kmin / BK * BK : kmax; k0 < kmax; k0 += BK) {
    const int64_t k1 = std::min(k0 + BK, kmax), nk = k1 - k0;
    bool any = false, full = true;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t c = mk.Count(r, k0, k1);
      any |= c > 0;
      full &= c == nk && (mk.tree[r] == kNoTree || k1 <= mk.base);
    }
    if (!any) continue;
    // Scores are computed for nk rounded up to whole 16-key tiles (zero keys past nk, whose scores are never
    // read): every key's score then comes from the same register tile whatever nk is. nk depends on the item's
    // other rows, and a key scored by a narrower tile or the plain loop (a separate multiply and add) differed in
    // its last bit, so a row's output changed with the rows computed beside it (a radix-cache hit against a
    // whole prefill).
    const int64_t nk_tiles = std::min<int64_t>(BK, (nk + 15) / 16 * 16);
    for (int64_t j = nk; j < nk_tiles; ++j)
      for (int64_t d = 0; d < D; ++d) kt[d * BK + j] = 0.f;
    for (int64_t j = 0; j < nk; ++j) {  // this block's K (transposed) and V rows of KV head kh, as float32
      const int64_t k = k0 + j, page = table[k / p.page_size];
      if (page < 0 || page >= p.num_pages) {
        for (int64_t d = 0; d < D; ++d) kt[d * BK + j] = 0.f;
        std::fill(vb.begin() + j * D, vb.begin() + (j + 1) * D, 0.f);
        continue;
      }
      const int64_t index = (page * p.page_size + k % p.page_size) * KVH + it.kh;
      const float* kr = RowF32(p.k, p.kv_bf16, index, D, tmp.data());
      for (int64_t d = 0; d < D; ++d) kt[d * BK + j] = kr[d];
      const float* vr = RowF32(p.v, p.kv_bf16, index, D, vb.data() + j * D);
      if (vr != vb.data() + j * D) std::memcpy(vb.data() + j * D, vr, D * sizeof(float));
    }
    Gemm(R, nk_tiles, D, x.data(), D, kt.data(), BK, s.data(), BK, false);
    for (int64_t i = 0; i < R; ++i) {
      float* __restrict si = s.data() + i * BK;
      if (p.soft_cap > 0.f)
        for (int64_t j = 0; j < nk; ++j) si[j] = p.soft_cap * std::tanh(si[j] / p.soft_cap);
      if (!full) mk.Apply(i / G, k0, nk, si);
      // The padding keys count as hidden, and the max and the exponentials run over whole tiles too: a key's
      // exponential and its lane of the sum are then the same whatever nk is.
      std::fill(si + nk, si + nk_tiles, -INFINITY);
      const float mx = std::max(m[i], RowMax(si, nk_tiles));
      if (mx == -INFINITY) {  // nothing seen yet: the state stays empty
        std::fill(si, si + nk_tiles, 0.f);
        scale[i] = 1.f;
        continue;
      }
      const float corr = m[i] == -INFINITY ? 0.f : FastExp(m[i] - mx);
      const float sum = ExpRow(si, nk_tiles, mx);
      l[i] = l[i] * corr + sum;
      m[i] = mx;
      scale[i] = corr;
    }
    // The block's P.V into its own tile, then acc = acc * corr + tile: each output sums at most kBlockK products
    // in one chain (accumulating straight into acc made it one chain over the whole context: 2x ref's error at
    // 2,000 keys of a packed scoring sequence).
    Gemm(R, D, nk, s.data(), BK, vb.data(), D, pv.data(), D, false);
    for (int64_t i = 0; i < R; ++i) {
      float* __restrict ai = acc.data() + i * D;
      const float* __restrict ti = pv.data() + i * D;
      const float c = scale[i];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ai[d] = ai[d] * c + ti[d];
    }
  }
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = it.q_start + it.r0 + r;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = r * G + g, o = (t * H + it.kh * G + g) * D;
      const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
      const float* a = acc.data() + i * D;
      if (p.q_bf16) {
        uint16_t* dst = static_cast<uint16_t*>(p.out) + o;
        for (int64_t d = 0; d < D; ++d) dst[d] = F32ToBf16(a[d] * inv);
      } else {
        float* dst = static_cast<float*>(p.out) + o;
        for (int64_t d = 0; d < D; ++d) dst[d] = a[d] * inv;
      }
    }
  }
}
