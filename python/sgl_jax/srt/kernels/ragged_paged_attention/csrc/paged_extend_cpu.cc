// Ragged paged attention of extend (prefill) and mixed batches for XLA's CPU backend, called through JAX's FFI
// (jax.ffi.ffi_call): the contract of ref.ragged_paged_attention without decode_only.
//
// Why a kernel: the pure-JAX extend attention (ref._extend_attention) is ~2,000 HLO instructions of nested
// loops, and a model's program holds one copy per layer (68% of the named instructions of an SmolLM2 extend
// program, 30 copies). XLA's CPU loader rebuilds every YNNPACK fusion thunk by scanning the module, so a cached
// program took 6-7.5 s to load and ~10 s to compile (reports/buckets-cpu-2026-12-06.notes.md). As a custom call,
// the attention is one instruction per layer.
//
// Work items: (sequence, block of kBlockQ query rows, KV head). An item's rows x G query heads are scored against
// kBlockK keys at a time by register-tiled matmuls, with FlashAttention's online softmax (Dao et al. 2022). Items
// run on XLA's intra-op thread pool and write disjoint output rows.
//
// Buffers (shapes as ref.ragged_paged_attention takes them):
//   q              [T, H, D]                      float32 or bfloat16, sequences' tokens concatenated
//   k_pages        [num_pages, page_size, KVH, D]  float32 or bfloat16
//   v_pages        like k_pages
//   kv_lens        int32[S]       keys per sequence, this step's included
//   page_indices   int32[S, P]
//   cu_q_lens      int32[S + 1]   cumulative query lengths
//   num_seqs       int32[]        sequences in use
//   prefix_lens    int32[S]       multi-item scoring: keys every segment sees (0: no segments)
//   segment_starts int32[T]       the key position where each query's segment starts (0: none)
//   tree_bits      int32[T]       draft-tree bits of a speculative verify row, or -1 (the causal mask alone)
// Result: [T, H, D] in q's dtype; rows of no sequence are zero. Query i of sequence s sits at key position
// kv_lens[s] - q_len + i and sees keys at positions <= it, within the sliding window, and (with segments) in the
// prefix or its own segment. Attributes: sm_scale, sliding_window (0: none), soft_cap (0: none), max_tree_slots.
// ref's shared_prefix_len is a promise that only changes the order of its work; it does not reach this kernel.
// Softmax in float32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_kernel_common.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#endif

namespace {

using namespace sgl_jax_cpu;

constexpr int64_t kBlockQ = 64;   // query rows per work item (x G heads: the matmuls' rows)
constexpr int64_t kBlockK = 128;  // keys per online-softmax step
constexpr int32_t kNoTree = -1;   // speculative/draft_tree.NO_TREE

struct ExtendProblem {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  bool q_bf16, kv_bf16;
  const int32_t* kv_lens;
  const int32_t* pages;
  const int32_t* prefix_lens;
  const int32_t* seg_starts;
  const int32_t* tree_bits;
  int64_t T, H, D, S, P, page_size, KVH, G, num_pages;
  float sm_scale, soft_cap;
  int64_t window, max_tree_slots;
};

struct Item {
  int64_t s, q_start, q_len, r0, rows, kh;
};

#define SGL_JAX_CORE_HEADER "paged_extend_cpu_core.h"
#include "isa_clones.h"

void AttendItem(const ExtendProblem& p, const Item& it) {
  return CpuHasAvx2Fma() ? avx2::AttendItemIsa(p, it) : baseline::AttendItemIsa(p, it);
}

bool IsVector(const ffi::Buffer<ffi::S32>& b, int64_t n) {
  return b.dimensions().size() == 1 && b.dimensions()[0] == n;
}

ffi::Error PagedExtendImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                           ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
                           ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                           ffi::Buffer<ffi::S32> prefix_lens, ffi::Buffer<ffi::S32> segment_starts,
                           ffi::Buffer<ffi::S32> tree_bits, ffi::Result<ffi::AnyBuffer> out, float sm_scale,
                           int64_t sliding_window, float soft_cap, int64_t max_tree_slots) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), pd = page_indices.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2)
    return ffi::Error::InvalidArgument("paged_extend: expected q [T,H,D], pages [N,ps,KVH,D], table [S,P]");
  if (!IsF32OrBf16(q.element_type()) || !IsF32OrBf16(k_pages.element_type()) ||
      k_pages.element_type() != v_pages.element_type() || out->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("paged_extend: q and pages must be float32 or bfloat16");
  ExtendProblem p;
  p.T = qd[0];
  p.H = qd[1];
  p.D = qd[2];
  p.num_pages = kd[0];
  p.page_size = kd[1];
  p.KVH = kd[2];
  p.S = pd[0];
  p.P = pd[1];
  if (kd[3] != p.D || p.KVH <= 0 || p.H % p.KVH != 0 || p.page_size <= 0 || !IsVector(kv_lens, p.S) ||
      !IsVector(cu_q_lens, p.S + 1) || !IsVector(prefix_lens, p.S) || !IsVector(segment_starts, p.T) ||
      !IsVector(tree_bits, p.T) || max_tree_slots < 1 || max_tree_slots > 32)
    return ffi::Error::InvalidArgument("paged_extend: head counts or sizes do not match");
  p.G = p.H / p.KVH;
  p.q = q.untyped_data();
  p.k = k_pages.untyped_data();
  p.v = v_pages.untyped_data();
  p.out = out->untyped_data();
  p.q_bf16 = q.element_type() == ffi::DataType::BF16;
  p.kv_bf16 = k_pages.element_type() == ffi::DataType::BF16;
  p.kv_lens = kv_lens.typed_data();
  p.pages = page_indices.typed_data();
  p.prefix_lens = prefix_lens.typed_data();
  p.seg_starts = segment_starts.typed_data();
  p.tree_bits = tree_bits.typed_data();
  p.sm_scale = sm_scale;
  p.soft_cap = soft_cap;
  p.window = sliding_window;
  p.max_tree_slots = max_tree_slots;

  std::memset(p.out, 0, out->size_bytes());
  const int32_t* cu = cu_q_lens.typed_data();
  const int64_t live = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, p.S);
  std::vector<Item> items;
  int64_t q_start = 0;
  for (int64_t s = 0; s < live; ++s) {
    // Rows [cu[s], cu[s + 1]) clamped to [previous end, T]: a malformed table gives fewer rows, never a read
    // outside q.
    const int64_t begin = std::clamp<int64_t>(cu[s], q_start, p.T);
    const int64_t end = std::clamp<int64_t>(cu[s + 1], begin, p.T);
    for (int64_t r0 = 0; r0 < end - begin; r0 += kBlockQ)
      for (int64_t kh = 0; kh < p.KVH; ++kh)
        items.push_back({s, begin, end - begin, r0, std::min(kBlockQ, end - begin - r0), kh});
    q_start = end;
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  ParallelFor(pool, static_cast<int64_t>(items.size()), threads - 1, [&](int64_t i) { AttendItem(p, items[i]); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SglJaxPagedExtend, PagedExtendImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("sm_scale")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("max_tree_slots"));
