// CPU back end: the CPU driver of the ops in ashl/ops.h. OpenMP threads each
// over one contiguous range of the tensors laid end to end, one SIMD loop per
// fp32 block (16-bit operands converted at the block's edges: halves.h).
#include <algorithm>
#include <array>
#include <string>
#include <type_traits>
#include <utility>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "ashl/kernels.h"
#include "convert.h"

namespace ashl::cpu {
namespace {

// fp32 accumulation blocks: small enough for L1.
constexpr int64_t kBlock = 2048;
// Blocks of an op with 16-bit operands: each operand widened into its own
// fp32 block, all of them in L1 together.
constexpr int64_t kHalfBlock = 1024;
// An op whose operands add up to more than a last-level cache (32 MiB, this VM's L3; the
// OS reports ten times that here, so it is not asked) writes its output with streaming
// stores: the output cannot stay cached as the inputs stream through anyway. Below it, an
// output stays for its next reader (the send, the forward pass).
constexpr int64_t kStreamBytes = int64_t(32) << 20;
// unpack_add streams its params by their own size (below).
constexpr int64_t kStreamOutputBytes = int64_t(16) << 20;
// merge_dense with `out`: merged and checked a block at a time (16 KiB of fp32
// delta: a 16-bit operand's block is merged, then checked from L1; fp32 in one loop).
constexpr int64_t kMergeBlock = 4096;
// Below this many elements in total, threads cost more than they save.
constexpr int64_t kParallelThreshold = 1 << 16;

int64_t total(const std::vector<int64_t>& numels) {
  int64_t n = 0;
  for (int64_t x : numels) n += x;
  return n;
}

// This thread's share of n elements: an equal, contiguous range (split points
// rounded to 16 elements, a cache line of fp32), as torch splits a flat op.
std::pair<int64_t, int64_t> thread_range(int64_t n) {
#ifdef _OPENMP
  const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
#else
  const int64_t id = 0, nt = 1;
#endif
  const auto split = [&](int64_t k) { return k == nt ? n : (n / nt * k) & ~int64_t(15); };
  return {split(id), split(id + 1)};
}

// f(tensor, begin, end) over the pieces of elements [lo, hi) of the tensors
// laid end to end.
template <class F>
void for_range(const std::vector<int64_t>& numels, int64_t lo, int64_t hi, F&& f) {
  int64_t base = 0;
  for (size_t t = 0; t < numels.size() && base < hi; base += numels[t], ++t) {
    const int64_t b = std::max(lo, base), e = std::min(hi, base + numels[t]);
    if (b < e) f(static_cast<int32_t>(t), b - base, e - base);
  }
}

// Runs f(tensor, begin, end) over every element of every tensor, each thread
// over one contiguous range of the whole list: long sequential streams for the
// prefetchers, and no per-tensor or per-chunk scheduling (a list of chunks
// measured 0.85-0.9x of one flat torch op; the same op on one flat tensor 0.95x).
template <class F>
void for_each_chunk(const std::vector<int64_t>& numels, F&& f) {
  const int64_t n = total(numels);
#pragma omp parallel if (n >= kParallelThreshold)
  {
    const auto [lo, hi] = thread_range(n);
    for_range(numels, lo, hi, f);
  }
}

// True if any element of any tensor of `l` is NaN/Inf.
template <class T>
bool any_nonfinite(const TensorList& l) {
  const int64_t n = total(l.numels);
  int bad = 0;
#pragma omp parallel reduction(| : bad) if (n >= kParallelThreshold)
  {
    const auto [lo, hi] = thread_range(n);
    for_range(l.numels, lo, hi, [&](int32_t t, int64_t b, int64_t e) {
      const T* p = static_cast<const T*>(l.ptrs[t]);
      int local = 0;
#pragma omp simd reduction(| : local)
      for (int64_t j = b; j < e; ++j) local |= nonfinite(p, j);
      bad |= local;
    });
  }
  return bad != 0;
}

// ---- the elementwise driver (CUDA's counterpart: Map in csrc/cuda) ----------

// Tensor t's elements as T*: a list's t-th tensor, or the slice of a flat
// buffer at offsets[t]. `stream`: an output written with streaming stores.
template <class T>
struct Operand {
  void* const* ptrs;
  T* flat;
  const int64_t* offsets;
  bool stream;
  T* at(int32_t t) const { return offsets ? flat + offsets[t] : static_cast<T*>(ptrs[t]); }
};

template <class T>
Operand<T> list(const TensorList& l, bool stream = false) {
  return {l.ptrs.data(), nullptr, nullptr, stream};
}

template <class T>
Operand<T> slices(const Flat& f, const std::vector<int64_t>& offsets, bool stream = false) {
  return {nullptr, static_cast<T*>(f.data), offsets.data(), stream};
}

// Writes one block to every output, each through its own inlined copy of
// store_block: one copy in a loop over the outputs, or behind a call, made
// unpack_assign 1.1x to 1.3x slower (their alignment heads differ).
template <class O, size_t NOut, size_t... k>
__attribute__((always_inline)) inline void store_outputs(const std::array<Operand<O>, NOut>& outs,
                                                         int32_t t, int64_t bb, const float* buf,
                                                         int64_t m, std::index_sequence<k...>) {
  (store_block(outs[k].at(t) + bb, buf, m, outs[k].stream), ...);
}

// A first block that starts at p and ends on a cache line, so that every later
// block starts on one: their streamed stores need no scalar head. `whole` where p
// is on a line already or is not O-aligned (written without streaming stores).
template <class O>
int64_t block_to_line(const O* p, int64_t whole) {
  const uintptr_t past = reinterpret_cast<uintptr_t>(p) & 63u;
  const int64_t head = static_cast<int64_t>(((64u - past) & 63u) / sizeof(O));
  return head > 0 && past % sizeof(O) == 0 ? head : whole;
}

// The first block ends where the first streamed output reaches a cache line.
template <class O, size_t NOut>
int64_t first_block(const std::array<Operand<O>, NOut>& outs, int32_t t, int64_t b) {
  for (const auto& o : outs)
    if (o.stream) return block_to_line(o.at(t) + b, kHalfBlock);
  return kHalfBlock;
}

// Elements [b, e) of one tensor with a 16-bit operand: each 16-bit input
// widened into an fp32 block (halves(): vectorised for this CPU), the op over
// the fp32 blocks, every output narrowed (or copied) out of the result block.
template <class Op, class O, size_t NOut, class... I, size_t... k>
void map_chunk_halves(const Op& op, const std::array<Operand<O>, NOut>& outs, int32_t t,
                      int64_t b, int64_t e, std::index_sequence<k...>, const I*... x) {
  float in[sizeof...(I)][kHalfBlock];
  float buf[kHalfBlock];
  int64_t m = 0;
  for (int64_t bb = b; bb < e; bb += m) {
    m = std::min(bb == b ? first_block(outs, t, b) : kHalfBlock, e - bb);
    const std::array<const float*, sizeof...(I)> v{fp32_block(x, bb, m, in[k])...};
#pragma omp simd
    for (int64_t j = 0; j < m; ++j) buf[j] = op(v[k][j]...);
    store_outputs(outs, t, bb, buf, m, std::make_index_sequence<NOut>{});
  }
}

// Elements [b, e) of one tensor, every operand fp32: the op over kLanes
// elements at a time, the result stored from its register to every output, a
// streamed one with non-temporal stores. (Streaming out of an L1 block instead
// measured no faster than normal stores: the block's copy ate the saving.)
template <class Op, size_t NOut, class... I, size_t... k>
void map_chunk_fp32(const Op& op, const std::array<Operand<float>, NOut>& outs, int32_t t,
                    int64_t b, int64_t e, std::index_sequence<k...>, const I*... x) {
  float* const o[NOut] = {outs[k].at(t)...};
  const auto scalar = [&](int64_t j) {
    const float v = op(load(x, j)...);
    ((o[k][j] = v), ...);
  };
  if (!(outs[k].stream || ...)) {  // the compiler's own vector loop
#pragma omp simd
    for (int64_t j = b; j < e; ++j) scalar(j);
    return;
  }
  // Scalar head up to the first streamed output's vector boundary; a streamed
  // output misaligned against it is written normally.
  int64_t j = b;
  for (size_t s = 0; s < NOut; ++s) {
    if (!outs[s].stream) continue;
    for (; j < e && !lane_aligned(o[s] + j); ++j) scalar(j);
    break;
  }
  const bool nt[NOut] = {(outs[k].stream && lane_aligned(o[k] + j))...};
  for (; j + kLanes <= e; j += kLanes) {
    float v[kLanes];
#pragma omp simd
    for (int64_t l = 0; l < kLanes; ++l) v[l] = op(load(x, j + l)...);
    (store_lanes(o[k] + j, v, nt[k]), ...);
  }
  for (; j < e; ++j) scalar(j);
}

// Elements [b, e) of one tensor: fp32 operands straight through registers
// (map_chunk_fp32), a 16-bit operand through fp32 blocks (map_chunk_halves).
template <class Op, class O, size_t NOut, class... I>
void map_chunk(const Op& op, const std::array<Operand<O>, NOut>& outs, int32_t t, int64_t b,
               int64_t e, const I*... x) {
  if constexpr (is_half<O> || (is_half<I> || ...))
    map_chunk_halves(op, outs, t, b, e, std::index_sequence_for<I...>{}, x...);
  else
    map_chunk_fp32(op, outs, t, b, e, std::make_index_sequence<NOut>{}, x...);
}

// Runs an elementwise op of ashl/ops.h over every element of every tensor:
// outs[k][i] = op(ins[0][i], ins[1][i], ...). Inputs are all read before an
// output is written, so an output may also be an input (in place).
template <class Op, class O, size_t NOut, class... I>
void map(const std::vector<int64_t>& numels, const Op& op,
         const std::array<Operand<O>, NOut>& outs, const Operand<I>&... ins) {
  bool stream = false;
  for (const auto& o : outs) stream = stream || o.stream;
  for_each_chunk(numels, [&](int32_t t, int64_t b, int64_t e) {
    map_chunk(op, outs, t, b, e, static_cast<const I*>(ins.at(t))...);
    if (stream) stream_fence();
  });
}

// Whether an op's output streams: when the op's whole footprint (`bytes` an element,
// every operand read or written) cannot stay cached, its output cannot either.
bool streams(const std::vector<int64_t>& numels, int64_t bytes) {
  return total(numels) * bytes >= kStreamBytes;
}

// ---- weighted_sum: up to four inputs per pass over the block ----------------

// acc (=|+=) sum_i w[i] * x[i] for a group of 1 to 4 inputs, summed left to
// right exactly as one-input-at-a-time would (same result, fewer passes).
template <int G>
void accumulate_fixed(float* acc, const float* const* x, const float* w, bool first, int64_t m) {
  if (first) {
#pragma omp simd
    for (int64_t j = 0; j < m; ++j) {
      float a = ops::AddScaled{w[0]}.term(x[0][j]);
      for (int i = 1; i < G; ++i) a = ops::AddScaled{w[i]}(a, x[i][j]);
      acc[j] = a;
    }
  } else {
#pragma omp simd
    for (int64_t j = 0; j < m; ++j) {
      float a = acc[j];
      for (int i = 0; i < G; ++i) a = ops::AddScaled{w[i]}(a, x[i][j]);
      acc[j] = a;
    }
  }
}

inline void accumulate_group(float* acc, const float* const* x, const float* w, size_t g,
                             bool first, int64_t m) {
  switch (g) {
    case 1: accumulate_fixed<1>(acc, x, w, first, m); break;
    case 2: accumulate_fixed<2>(acc, x, w, first, m); break;
    case 3: accumulate_fixed<3>(acc, x, w, first, m); break;
    default: accumulate_fixed<4>(acc, x, w, first, m); break;
  }
}

// Tensor t's elements [b, e) of out = sum_k w[k] * inputs[k]. Accumulates a
// cache-resident fp32 block, up to four inputs per pass: fewer passes over acc,
// and few enough concurrent streams for the hardware prefetchers (one input at
// a time fell off a cliff at K=4).
// 16-bit inputs are widened into fp32 blocks first (halves()); a streamed output's
// blocks start on cache lines after the first (block_to_line).
template <class O, class I>
void weighted_sum_chunk(O* o, const std::vector<TensorList>& inputs, const float* w, int32_t t,
                        int64_t b, int64_t e, bool stream) {
  constexpr int64_t B = is_half<I> ? kHalfBlock : kBlock;
  const size_t K = inputs.size();
  float acc[B];
  float in[is_half<I> ? 4 : 1][B];
  int64_t m = 0;
  for (int64_t bb = b; bb < e; bb += m) {
    m = std::min(bb == b && stream ? block_to_line(o + b, B) : B, e - bb);
    for (size_t k = 0; k < K; k += 4) {
      const float* x[4];
      const size_t g = std::min<size_t>(4, K - k);
      for (size_t i = 0; i < g; ++i)
        x[i] = fp32_block(static_cast<const I*>(inputs[k + i].ptrs[t]), bb, m,
                          in[is_half<I> ? i : 0]);
      accumulate_group(acc, x, w + k, g, k == 0, m);
    }
    store_block(o + bb, acc, m, stream);
  }
}

// ---- merge_sparse: checks, then a scatter ----------------------------------

struct SparseCheck {
  bool finite;     // every value finite
  bool ascending;  // indices non-decreasing (top-k sends them so)
};

// Throws std::out_of_range naming the first index outside [0, n) (an index
// error wins over a bad value).
template <class I, class V>
SparseCheck check_sparse(int64_t n, const I* idx, const V* val, int64_t nnz) {
  const auto bad_index = [n](int64_t i) { return int((i < 0) | (i >= n)); };
  int out_of_range = 0, bad_value = 0, descends = 0;
  if (nnz > 0) {
    out_of_range = bad_index(static_cast<int64_t>(idx[0]));
    bad_value = nonfinite(val, 0);
  }
#pragma omp simd reduction(| : out_of_range, bad_value, descends)
  for (int64_t k = 1; k < nnz; ++k) {
    const int64_t i = static_cast<int64_t>(idx[k]);
    out_of_range |= bad_index(i);
    bad_value |= nonfinite(val, k);
    descends |= int(i < static_cast<int64_t>(idx[k - 1]));
  }
  for (int64_t k = 0; out_of_range && k < nnz; ++k) {
    const int64_t i = static_cast<int64_t>(idx[k]);
    if (i < 0 || i >= n)
      throw std::out_of_range("indices[" + std::to_string(k) + "] = " + std::to_string(i) +
                              " is out of range for a buffer of " + std::to_string(n) +
                              " elements");
  }
  return {bad_value == 0, descends == 0};
}

// Where a thread's share of ascending indices starts: at its equal share of the
// positions, moved past a run of equal indices, so that every add to one element
// happens in one thread, in order (the serial bits, duplicates included).
template <class I>
int64_t run_start(const I* idx, int64_t nnz, int64_t part, int64_t parts) {
  if (part == 0) return 0;
  int64_t p = part == parts ? nnz : nnz / parts * part;
  while (p > 0 && p < nnz && idx[p] == idx[p - 1]) ++p;
  return p;
}

// Ascending indices are split among the threads (each thread's elements then lie
// apart from the others'); any other order is scattered by one thread. The scatter
// waits on memory, a cache line per index: on a quiet machine two threads were 1.6x
// faster (99 MB buffer, 248K sorted indices), as a dense op's second thread is.
template <class I, class V, class D>
bool merge_sparse_typed(Tag<I>, Tag<V>, Tag<D>, Flat dst, const void* indices, const void* values,
                        int64_t nnz, float weight) {
  const I* idx = static_cast<const I*>(indices);
  const V* val = static_cast<const V*>(values);
  const SparseCheck checked = check_sparse(dst.numel, idx, val, nnz);
  if (!checked.finite) return false;
  const ops::AddScaled op{weight};
  D* d = static_cast<D*>(dst.data);
  const auto scatter = [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const int64_t i = static_cast<int64_t>(idx[k]);
      store(d, i, op(load(d, i), load(val, k)));
    }
  };
#pragma omp parallel if (checked.ascending && nnz >= kParallelThreshold)
  {
#ifdef _OPENMP
    const int64_t id = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int64_t id = 0, nt = 1;
#endif
    scatter(run_start(idx, nnz, id, nt), run_start(idx, nnz, id + 1, nt));
  }
  return true;
}

}  // namespace

// ---- public API -------------------------------------------------------------

void pack_delta(const TensorList& params, const TensorList& anchors, const TensorList* residuals,
                const std::vector<int64_t>& offsets, Flat out, float scale) {
  check_pack_delta(params, anchors, residuals, offsets, out, scale);
  dispatch_float<HostStorage>(params.dtype, "params", out.dtype, "out", [&](auto pt, auto ft) {
    using P = typename decltype(pt)::type;
    using F = typename decltype(ft)::type;
    // Streamed when too large to stay cached until the send reads it: straight from
    // the registers that saves the read-for-ownership, 1.3-1.6x normal stores here.
    const int64_t bytes = (residuals ? 3 : 2) * dtype_size(params.dtype) + dtype_size(out.dtype);
    const std::array o{slices<F>(out, offsets, streams(params.numels, bytes))};
    if (residuals)
      map(params.numels, ops::DeltaResidual{scale}, o, list<P>(params), list<P>(anchors),
          list<P>(*residuals));
    else
      map(params.numels, ops::Delta{scale}, o, list<P>(params), list<P>(anchors));
  });
}

namespace {
template <bool kAdd>
void unpack(const TensorList& params, const TensorList& anchors,
            const std::vector<int64_t>& offsets, Flat flat) {
  check_unpack(params, anchors, offsets, flat);
  // unpack_add's params: by their own size (streamed beside the anchors' normal stores
  // as soon as the footprint passed the cache, it measured 0.77x torch on 14 MB)
  const bool stream =
      kAdd ? total(params.numels) * dtype_size(params.dtype) >= kStreamOutputBytes
           : streams(params.numels, 2 * dtype_size(params.dtype) + dtype_size(flat.dtype));
  dispatch_float<HostStorage>(params.dtype, "params", flat.dtype, "flat", [&](auto pt, auto ft) {
    using P = typename decltype(pt)::type;
    const auto f = slices<typename decltype(ft)::type>(flat, offsets);
    if constexpr (kAdd)  // anchors were just read: in cache, so written normally
      map(params.numels, ops::Add{}, std::array{list<P>(anchors), list<P>(params, stream)},
          list<P>(anchors), f);
    else
      map(params.numels, ops::Assign{},
          std::array{list<P>(anchors, stream), list<P>(params, stream)}, f);
  });
}
}  // namespace

void unpack_assign(const TensorList& params, const TensorList& anchors,
                   const std::vector<int64_t>& offsets, Flat flat) {
  unpack<false>(params, anchors, offsets, flat);
}

void unpack_add(const TensorList& params, const TensorList& anchors,
                const std::vector<int64_t>& offsets, Flat flat) {
  unpack<true>(params, anchors, offsets, flat);
}

namespace {
// o[j] = d[j] + w * x[j] for j in [b, e), all fp32, in one loop that also tests x:
// true if any x[j] is NaN/Inf. With `stream`, o's lanes go out non-temporally after
// a scalar head up to its vector boundary.
bool merge_checked_fp32(float* o, const float* d, const float* x, int64_t b, int64_t e,
                        const ops::AddScaled& op, bool stream) {
  int bad = 0;
  int64_t j = b;
  if (stream) {
    for (; j < e && !lane_aligned(o + j); ++j) {
      o[j] = op(d[j], x[j]);
      bad |= ops::nonfinite(x[j]);
    }
    for (; j + kLanes <= e; j += kLanes) {
      float v[kLanes];
#pragma omp simd reduction(| : bad)
      for (int64_t l = 0; l < kLanes; ++l) {
        v[l] = op(d[j + l], x[j + l]);
        bad |= ops::nonfinite(x[j + l]);
      }
      store_lanes(o + j, v, true);
    }
  }
#pragma omp simd reduction(| : bad)
  for (int64_t k = j; k < e; ++k) {
    o[k] = op(d[k], x[k]);
    bad |= ops::nonfinite(x[k]);
  }
  return bad != 0;
}

// out = dst + w * delta, each thread over its range in blocks: a block is merged (dst
// and delta streamed in together, out streamed out), then its delta checked while still
// in L1. out is only scratch until the caller adopts it, so nothing need be checked
// before it is written: every operand crosses memory once (12 bytes an element, against
// 16 for a check pass and an in-place merge pass). A thread that meets a non-finite
// delta stops at the end of that block: out is then garbage, and dst was never written.
template <class D, class X>
bool merge_dense_out(const TensorList& dst, const TensorList& delta, const TensorList& out,
                     float weight) {
  const auto o = std::array{
      list<D>(out, streams(dst.numels, 2 * dtype_size(dst.dtype) + dtype_size(delta.dtype)))};
  const auto d = list<D>(dst);
  const auto x = list<X>(delta);
  const ops::AddScaled op{weight};
  const int64_t n = total(dst.numels);
  int bad = 0;
#pragma omp parallel reduction(| : bad) if (n >= kParallelThreshold)
  {
    const auto [lo, hi] = thread_range(n);
    for_range(dst.numels, lo, hi, [&](int32_t t, int64_t b, int64_t e) {
      const X* xt = x.at(t);
      for (int64_t bb = b; bb < e && !bad; bb += kMergeBlock) {
        const int64_t be = std::min(e, bb + kMergeBlock);
        if constexpr (std::is_same_v<D, float> && std::is_same_v<X, float>) {
          bad |= merge_checked_fp32(o[0].at(t), d.at(t), xt, bb, be, op, o[0].stream);
          continue;
        }
        map_chunk(op, o, t, bb, be, d.at(t), xt);
        int local = 0;
#pragma omp simd reduction(| : local)
        for (int64_t j = bb; j < be; ++j) local |= nonfinite(xt, j);
        bad |= local;
      }
    });
    if (o[0].stream) stream_fence();
  }
  return bad == 0;
}
}  // namespace

bool merge_dense(const TensorList& dst, const TensorList& delta, float weight,
                 const TensorList* out) {
  check_merge_dense(dst, delta, weight, out);
  bool ok = true;
  dispatch_float<HostStorage>(dst.dtype, "dst", delta.dtype, "delta", [&](auto dt, auto xt) {
    using D = typename decltype(dt)::type;
    using X = typename decltype(xt)::type;
    if (out) {
      ok = merge_dense_out<D, X>(dst, delta, *out, weight);
      return;
    }
    // Check everything before writing anything: a poisoned delta must not
    // touch the global model, not even partly.
    if (any_nonfinite<X>(delta)) { ok = false; return; }
    map(dst.numels, ops::AddScaled{weight}, std::array{list<D>(dst)}, list<D>(dst), list<X>(delta));
  });
  return ok;
}

bool merge_sparse(Flat dst, const void* indices, DType index_dtype, const void* values,
                  DType value_dtype, int64_t nnz, float weight) {
  check_merge_sparse(dst, indices, index_dtype, values, value_dtype, nnz, weight);
  bool ok = true;
  dispatch_sparse<HostStorage>(index_dtype, value_dtype, dst.dtype, [&](auto i, auto v, auto d) {
    ok = merge_sparse_typed(i, v, d, dst, indices, values, nnz, weight);
  });
  return ok;
}

void weighted_sum(const TensorList& out, const std::vector<TensorList>& inputs,
                  const std::vector<float>& weights) {
  check_weighted_sum(out, inputs, weights);
  const DType in_dtype = inputs.empty() ? out.dtype : inputs[0].dtype;
  const bool stream = streams(out.numels, dtype_size(out.dtype) + static_cast<int64_t>(
      inputs.size()) * dtype_size(inputs.empty() ? out.dtype : inputs[0].dtype));
  dispatch_float<HostStorage>(out.dtype, "out", in_dtype, "inputs", [&](auto ot, auto it) {
    using O = typename decltype(ot)::type;
    using I = typename decltype(it)::type;
    // Up to four inputs: one map pass, streamed from the registers like the other ops.
    const std::array o{list<O>(out, stream)};
    const float* w = weights.data();
    const auto in = [&](size_t k) { return list<I>(inputs[k]); };
    switch (inputs.size()) {
      case 1: return map(out.numels, ops::WeightedSum<1>{{w[0]}}, o, in(0));
      case 2: return map(out.numels, ops::WeightedSum<2>{{w[0], w[1]}}, o, in(0), in(1));
      case 3:
        return map(out.numels, ops::WeightedSum<3>{{w[0], w[1], w[2]}}, o, in(0), in(1), in(2));
      case 4:
        return map(out.numels, ops::WeightedSum<4>{{w[0], w[1], w[2], w[3]}}, o, in(0), in(1),
                   in(2), in(3));
      default: break;
    }
    for_each_chunk(out.numels, [&](int32_t t, int64_t b, int64_t e) {
      O* o = static_cast<O*>(out.ptrs[t]);
      if (inputs.empty()) {
        for (int64_t j = b; j < e; ++j) store(o, j, 0.0f);
        return;
      }
      weighted_sum_chunk<O, I>(o, inputs, weights.data(), t, b, e, stream);
      if (stream) stream_fence();
    });
  });
}

int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

void set_num_threads(int n) {
  if (n < 1) throw std::invalid_argument("thread count must be >= 1, got " + std::to_string(n));
#ifdef _OPENMP
  omp_set_num_threads(n);
#endif
}

}  // namespace ashl::cpu
