// Paged decode attention for XLA's CPU backend, called through JAX's FFI (jax.ffi.ffi_call).
//
// One query token per sequence attends to its sequence's keys and values, read in place from the paged KV
// cache. The pure-JAX path (ref._decode_attention) gathers every KV row into a fresh buffer first; on CPU
// that copy, not the arithmetic, is the cost (one layer of SmolLM2 at 64 sequences x 1,500 tokens: ~30-55
// ms against ~5 ms to read the bytes once). Here each work item (a sequence, or a split of a long one's
// context) streams its K and V rows once, every query head scored against the row of its KV head
// (flash-decoding, Dao et al. 2023: the splits' partial softmax states are combined at the end). Work items
// run on XLA's intra-op thread pool.
//
// Buffers (shapes as ref.ragged_paged_attention's decode path takes them):
//   q            [T, H, D]                     float32 or bfloat16; row s is sequence s's query
//   k_pages      [num_pages, page_size, KVH, D] float32 or bfloat16
//   v_pages      like k_pages
//   kv_lens      int32[S]                      keys per sequence, this step's included
//   page_indices int32[S, pages_per_seq]
//   num_seqs     int32[]                       sequences in use (rows past them are padding)
// Result: [T, H, D] in q's dtype; rows >= min(num_seqs, T) are zero.
// Attributes: sm_scale (f32), sliding_window (i64, 0: none; keys at positions > q_pos - window are seen),
// soft_cap (f32, 0: none; scores become soft_cap * tanh(scores / soft_cap)). Softmax runs in float32.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_kernel_common.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using namespace sgl_jax_cpu;

// Keys scored before their values are read (8 to 64 measured alike at pages 16-64; 8 best at page 1).
constexpr int kChunk = 8;
constexpr int64_t kSplitKeys = 1024;  // a sequence's context runs as one work item per this many keys

struct Problem {
  const void* q;
  const void* k;
  const void* v;
  bool q_bf16, kv_bf16;
  const int32_t* kv_lens;
  const int32_t* pages;
  int64_t T, H, D, S, P, page_size, KVH, G;
  int64_t live;  // sequences with an output row: min(num_seqs, T)
  float sm_scale, soft_cap;
  int64_t window;
};

// The online-softmax state of one work item (a sequence, or one split of its context) for every query head:
// max m[H], sum l[H], acc[H][D].
struct Partial {
  std::vector<float> m, l, acc;
};

#define SGL_JAX_CORE_HEADER "paged_decode_cpu_core.h"
#include "isa_clones.h"

// The inner loops for this CPU: the AVX2 + FMA build where the CPU has both (x86-64 with GCC), else baseline.
void AttendRange(const Problem& p, int64_t s, int64_t lo, int64_t hi, Partial& out) {
  return CpuHasAvx2Fma() ? avx2::AttendRangeIsa(p, s, lo, hi, out) : baseline::AttendRangeIsa(p, s, lo, hi, out);
}

// Combines a sequence's splits and writes its H output rows.
void Finish(const Problem& p, int64_t s, const Partial* parts, int64_t n, void* out) {
  const int64_t H = p.H, D = p.D;
  std::vector<float> row(D);
  for (int64_t hq = 0; hq < H; ++hq) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, parts[i].m[hq]);
    float l = 0.f;
    std::fill(row.begin(), row.end(), 0.f);
    if (m > -INFINITY) {
      for (int64_t i = 0; i < n; ++i) {
        if (parts[i].l[hq] == 0.f) continue;
        const float c = std::exp(parts[i].m[hq] - m);
        l += parts[i].l[hq] * c;
        const float* a = &parts[i].acc[hq * D];
        for (int64_t d = 0; d < D; ++d) row[d] += a[d] * c;
      }
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int64_t o = (s * H + hq) * D;
    if (p.q_bf16) {
      uint16_t* dst = static_cast<uint16_t*>(out) + o;
      for (int64_t d = 0; d < D; ++d) dst[d] = F32ToBf16(row[d] * inv);
    } else {
      float* dst = static_cast<float*>(out) + o;
      for (int64_t d = 0; d < D; ++d) dst[d] = row[d] * inv;
    }
  }
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                           ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
                           ffi::Buffer<ffi::S32> num_seqs, ffi::Result<ffi::AnyBuffer> out, float sm_scale,
                           int64_t sliding_window, float soft_cap) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto pd = page_indices.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2 || kv_lens.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("paged_decode: expected q [T,H,D], pages [N,ps,KVH,D], table [S,P]");
  if (!IsF32OrBf16(q.element_type()) || !IsF32OrBf16(k_pages.element_type()) ||
      k_pages.element_type() != v_pages.element_type() || out->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("paged_decode: q and pages must be float32 or bfloat16");
  Problem p;
  p.T = qd[0];
  p.H = qd[1];
  p.D = qd[2];
  p.page_size = kd[1];
  p.KVH = kd[2];
  p.S = pd[0];
  p.P = pd[1];
  if (kd[3] != p.D || p.KVH <= 0 || p.H % p.KVH != 0 || kv_lens.dimensions()[0] != p.S)
    return ffi::Error::InvalidArgument("paged_decode: head counts or sizes do not match");
  p.G = p.H / p.KVH;
  p.q = q.untyped_data();
  p.k = k_pages.untyped_data();
  p.v = v_pages.untyped_data();
  p.q_bf16 = q.element_type() == ffi::DataType::BF16;
  p.kv_bf16 = k_pages.element_type() == ffi::DataType::BF16;
  p.kv_lens = kv_lens.typed_data();
  p.pages = page_indices.typed_data();
  p.sm_scale = sm_scale;
  p.soft_cap = soft_cap;
  p.window = sliding_window;
  p.live = std::max<int64_t>(0, std::min<int64_t>(num_seqs.typed_data()[0], std::min(p.S, p.T)));

  std::memset(out->untyped_data(), 0, out->size_bytes());
  // Key range of each live sequence, clamped to its page table.
  std::vector<int64_t> lo(p.live), hi(p.live);
  for (int64_t s = 0; s < p.live; ++s) {
    hi[s] = std::clamp<int64_t>(p.kv_lens[s], 0, p.P * p.page_size);
    lo[s] = p.window > 0 ? std::clamp<int64_t>(hi[s] - p.window, 0, hi[s]) : 0;
  }
  if (p.live == 0) return ffi::Error::Success();
  // Context splits: a sequence of len keys runs as ceil(len / kSplitKeys) work items of equal length, combined at
  // the end. The count depends on the sequence alone, never on the batch or the thread count, so a sequence's
  // output is the same bits whatever it is batched with (batch invariance, which the cache tests rely on).
  std::vector<int64_t> first(p.live + 1, 0);  // work items [first[s], first[s + 1]) are sequence s's splits
  for (int64_t s = 0; s < p.live; ++s)
    first[s + 1] = first[s] + std::max<int64_t>(1, (hi[s] - lo[s] + kSplitKeys - 1) / kSplitKeys);
  const int64_t items = first[p.live];
  std::vector<int64_t> owner(items);
  for (int64_t s = 0; s < p.live; ++s)
    for (int64_t i = first[s]; i < first[s + 1]; ++i) owner[i] = s;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  std::vector<Partial> parts(items);
  ParallelFor(pool, items, threads - 1, [&](int64_t i) {
    const int64_t s = owner[i], splits = first[s + 1] - first[s], split = i - first[s];
    const int64_t len = hi[s] - lo[s], a = lo[s] + len * split / splits, b = lo[s] + len * (split + 1) / splits;
    AttendRange(p, s, a, b, parts[i]);
  });
  ParallelFor(pool, p.live, threads - 1, [&](int64_t s) {
    Finish(p, s, &parts[first[s]], first[s + 1] - first[s], out->untyped_data());
  });
  return ffi::Error::Success();
}



// Paged KV write: each token's K and V row copied into its slot of the pages, in place.
//
// XLA's CPU backend runs a bfloat16 scatter in float32: it converts the whole cache to float32, scatters and
// converts back, so `pages.at[page, offset].set(rows)` costs O(pool) a step (~250 ms a step at 2M tokens of
// one small layer's cache against ~0.01 ms in float32). This handler is that scatter for bfloat16 pages, with
// the pages aliased from argument to result (jax.ffi.ffi_call's input_output_aliases): XLA hands the donated
// buffers over, and only the T rows are written.
//
// Buffers: k_pages, v_pages [num_pages, page_size, KVH, D] (any one dtype; results alias them); k, v [T, KVH, D]
// in the pages' dtype; loc int32[T], the flat slot (page * page_size + offset) of each token. A slot outside
// [0, num_pages * page_size) writes nothing (the scatter's mode="drop"); for a slot given twice the last row wins.
bool SameDims(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b) {
  const auto x = a.dimensions(), y = b.dimensions();
  return x.size() == y.size() && std::equal(x.begin(), x.end(), y.begin());
}

ffi::Error PagedKVWriteImpl(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::Buffer<ffi::S32> loc, ffi::Result<ffi::AnyBuffer> k_out,
                            ffi::Result<ffi::AnyBuffer> v_out) {
  const auto kd = k_pages.dimensions();
  const auto rd = k.dimensions();
  if (kd.size() != 4 || rd.size() != 3 || !SameDims(k_pages, v_pages) || !SameDims(k, v) ||
      rd[1] != kd[2] || rd[2] != kd[3] || loc.dimensions().size() != 1 || loc.dimensions()[0] != rd[0])
    return ffi::Error::InvalidArgument("paged_kv_write: expected pages [N,ps,KVH,D], rows [T,KVH,D], loc [T]");
  const auto dt = k_pages.element_type();
  if (v_pages.element_type() != dt || k.element_type() != dt || v.element_type() != dt ||
      k_out->element_type() != dt || v_out->element_type() != dt)
    return ffi::Error::InvalidArgument("paged_kv_write: pages and rows must have one dtype");
  const int64_t slots = kd[0] * kd[1], tokens = rd[0];
  const size_t row_bytes = tokens > 0 ? k.size_bytes() / tokens : 0;
  struct Part {
    const ffi::AnyBuffer* pages;
    const ffi::AnyBuffer* rows;
    void* out;
  };
  const Part parts[] = {{&k_pages, &k, k_out->untyped_data()}, {&v_pages, &v, v_out->untyped_data()}};
  for (const Part& x : parts) {
    char* dst = static_cast<char*>(x.out);
    if (dst != x.pages->untyped_data())  // (not aliased: XLA could not donate; start from a copy)
      std::memcpy(dst, x.pages->untyped_data(), x.pages->size_bytes());
    const char* src = static_cast<const char*>(x.rows->untyped_data());
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t slot = loc.typed_data()[t];
      if (slot >= 0 && slot < slots) std::memcpy(dst + slot * row_bytes, src + t * row_bytes, row_bytes);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SglJaxPagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SglJaxPagedKVWrite, PagedKVWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
