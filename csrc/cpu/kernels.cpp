// CPU back end: OpenMP over a (tensor, chunk) work list, one SIMD loop per item.
#include <algorithm>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "ashl/kernels.h"
#include "convert.h"

namespace ashl::cpu {
namespace {

// 32K elements: big enough to amortise scheduling, small enough to balance
// a few hundred unequal tensors over the cores.
constexpr int64_t kChunk = 32768;
// fp32 accumulation blocks: small enough for L1.
constexpr int64_t kBlock = 2048;
// Outputs at least this large are written with streaming stores (they cannot
// stay in a cache of a few tens of MiB anyway).
constexpr int64_t kStreamBytes = int64_t(16) << 20;
// Below this many elements in total, threads cost more than they save.
constexpr int64_t kParallelThreshold = 1 << 16;

struct WorkItem {
  int32_t tensor;
  int64_t begin, end;
};

std::vector<WorkItem> make_work(const std::vector<int64_t>& numels) {
  std::vector<WorkItem> work;
  for (size_t t = 0; t < numels.size(); ++t)
    for (int64_t b = 0; b < numels[t]; b += kChunk)
      work.push_back({static_cast<int32_t>(t), b, std::min(numels[t], b + kChunk)});
  return work;
}

int64_t total(const std::vector<int64_t>& numels) {
  int64_t n = 0;
  for (int64_t x : numels) n += x;
  return n;
}

// Runs f(tensor, begin, end) over every chunk of every tensor.
template <class F>
void for_each_chunk(const std::vector<int64_t>& numels, F&& f) {
  const auto work = make_work(numels);
  const int64_t n = static_cast<int64_t>(work.size());
#pragma omp parallel for schedule(static) if (total(numels) >= kParallelThreshold)
  for (int64_t w = 0; w < n; ++w) f(work[w].tensor, work[w].begin, work[w].end);
}

// True if any element of any tensor of `l` is NaN/Inf.
template <class T>
bool any_nonfinite(const TensorList& l) {
  const auto work = make_work(l.numels);
  const int64_t n = static_cast<int64_t>(work.size());
  int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad) if (total(l.numels) >= kParallelThreshold)
  for (int64_t w = 0; w < n; ++w) {
    const T* p = static_cast<const T*>(l.ptrs[work[w].tensor]);
    int local = 0;
#pragma omp simd reduction(| : local)
    for (int64_t j = work[w].begin; j < work[w].end; ++j) local |= nonfinite(p, j);
    bad |= local;
  }
  return bad != 0;
}

// acc (=|+=) sum_i w[i] * x[i] for a group of 1 to 4 inputs, summed left to
// right exactly as one-input-at-a-time would (same result, fewer passes).
template <int G, class I>
void accumulate_fixed(float* acc, const I* const* x, const float* w, bool first, int64_t m) {
  if (first) {
#pragma omp simd
    for (int64_t j = 0; j < m; ++j) {
      float a = w[0] * load(x[0], j);
      for (int i = 1; i < G; ++i) a += w[i] * load(x[i], j);
      acc[j] = a;
    }
  } else {
#pragma omp simd
    for (int64_t j = 0; j < m; ++j) {
      float a = acc[j];
      for (int i = 0; i < G; ++i) a += w[i] * load(x[i], j);
      acc[j] = a;
    }
  }
}

template <class I>
void accumulate_group(float* acc, const I* const* x, const float* w, size_t g, bool first,
                      int64_t m) {
  switch (g) {
    case 1: accumulate_fixed<1>(acc, x, w, first, m); break;
    case 2: accumulate_fixed<2>(acc, x, w, first, m); break;
    case 3: accumulate_fixed<3>(acc, x, w, first, m); break;
    default: accumulate_fixed<4>(acc, x, w, first, m); break;
  }
}

}  // namespace

void pack_delta(const TensorList& params, const TensorList& anchors, const TensorList* residuals,
                const std::vector<int64_t>& offsets, Flat out, float scale) {
  check_pack_delta(params, anchors, residuals, offsets, out, scale);
  dispatch_float(params.dtype, "params", [&](auto ptag) {
    using P = decltype(ptag);
    dispatch_float(out.dtype, "out", [&](auto ftag) {
      using F = decltype(ftag);
      const bool stream = total(params.numels) * dtype_size(out.dtype) >= kStreamBytes;
      for_each_chunk(params.numels, [&](int32_t t, int64_t b, int64_t e) {
        const P* p = static_cast<const P*>(params.ptrs[t]);
        const P* a = static_cast<const P*>(anchors.ptrs[t]);
        const P* r = residuals ? static_cast<const P*>(residuals->ptrs[t]) : nullptr;
        F* o = static_cast<F*>(out.data) + offsets[t];
        float buf[kBlock];
        for (int64_t bb = b; bb < e; bb += kBlock) {
          const int64_t m = std::min(kBlock, e - bb);
          if (r) {
#pragma omp simd
            for (int64_t j = 0; j < m; ++j)
              buf[j] = scale * (load(p, bb + j) - load(a, bb + j)) + load(r, bb + j);
          } else {
#pragma omp simd
            for (int64_t j = 0; j < m; ++j) buf[j] = scale * (load(p, bb + j) - load(a, bb + j));
          }
          store_block(o + bb, buf, m, stream);
        }
        if (stream) stream_fence();
      });
    });
  });
}

namespace {
// Shared body of unpack_assign / unpack_add: fp32 block v = f (+ a), then
// a = v and p = v. p is written through store_block (streaming when large);
// both roundings of v are identical, so p and a get the same bits.
template <bool kAdd>
void unpack(const TensorList& params, const TensorList& anchors,
            const std::vector<int64_t>& offsets, Flat flat) {
  check_unpack(params, anchors, offsets, flat);
  const bool stream = total(params.numels) * dtype_size(params.dtype) >= kStreamBytes;
  dispatch_float(params.dtype, "params", [&](auto ptag) {
    using P = decltype(ptag);
    dispatch_float(flat.dtype, "flat", [&](auto ftag) {
      using F = decltype(ftag);
      for_each_chunk(params.numels, [&](int32_t t, int64_t b, int64_t e) {
        P* p = static_cast<P*>(params.ptrs[t]);
        P* a = static_cast<P*>(anchors.ptrs[t]);
        const F* f = static_cast<const F*>(flat.data) + offsets[t];
        float buf[kBlock];
        for (int64_t bb = b; bb < e; bb += kBlock) {
          const int64_t m = std::min(kBlock, e - bb);
          if (kAdd) {
#pragma omp simd
            for (int64_t j = 0; j < m; ++j) buf[j] = load(a, bb + j) + load(f, bb + j);
            store_block(a + bb, buf, m, false);  // a was just read: in cache
          } else {
#pragma omp simd
            for (int64_t j = 0; j < m; ++j) buf[j] = load(f, bb + j);
            store_block(a + bb, buf, m, stream);
          }
          store_block(p + bb, buf, m, stream);
        }
        if (stream) stream_fence();
      });
    });
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

bool merge_dense(const TensorList& dst, const TensorList& delta, float weight) {
  check_same_shape(dst, delta, "dst", "delta");
  require_finite_weight(weight, "weight");
  bool ok = true;
  dispatch_float(dst.dtype, "dst", [&](auto dtag) {
    using D = decltype(dtag);
    dispatch_float(delta.dtype, "delta", [&](auto etag) {
      using E = decltype(etag);
      // Check everything before writing anything: a poisoned delta must not
      // touch the global model, not even partly.
      if (any_nonfinite<E>(delta)) { ok = false; return; }
      for_each_chunk(dst.numels, [&](int32_t t, int64_t b, int64_t e) {
        D* d = static_cast<D*>(dst.ptrs[t]);
        const E* x = static_cast<const E*>(delta.ptrs[t]);
#pragma omp simd
        for (int64_t j = b; j < e; ++j) store(d, j, load(d, j) + weight * load(x, j));
      });
    });
  });
  return ok;
}

namespace {
template <class I, class V, class D>
bool merge_sparse_typed(Flat dst, const I* idx, const V* val, int64_t nnz, float weight) {
  const int64_t n = dst.numel;
  int out_of_range = 0, bad_value = 0;
#pragma omp simd reduction(| : out_of_range, bad_value)
  for (int64_t k = 0; k < nnz; ++k) {
    const int64_t i = static_cast<int64_t>(idx[k]);
    out_of_range |= (i < 0) | (i >= n);
    bad_value |= nonfinite(val, k);
  }
  if (out_of_range) {
    for (int64_t k = 0; k < nnz; ++k) {
      const int64_t i = static_cast<int64_t>(idx[k]);
      if (i < 0 || i >= n)
        throw std::out_of_range("indices[" + std::to_string(k) + "] = " + std::to_string(i) +
                                " is out of range for a buffer of " + std::to_string(n) +
                                " elements");
    }
  }
  if (bad_value) return false;
  // One thread: a top-k scatter touches a few hundred thousand cache lines at most, and a
  // parallel region on a loaded machine waits a whole time slice for its slowest thread
  // (measured: 0.2 ms serial against 12 ms for two threads beside another busy process).
  // Serial also keeps duplicate indices accumulating in order.
  D* d = static_cast<D*>(dst.data);
  for (int64_t k = 0; k < nnz; ++k) {
    const int64_t i = static_cast<int64_t>(idx[k]);
    store(d, i, load(d, i) + weight * load(val, k));
  }
  return true;
}
}  // namespace

bool merge_sparse(Flat dst, const void* indices, DType index_dtype, const void* values,
                  DType value_dtype, int64_t nnz, float weight) {
  if (nnz < 0) throw std::invalid_argument("nnz is negative");
  if (nnz > 0 && (indices == nullptr || values == nullptr))
    throw std::invalid_argument("indices/values: null pointer");
  if (dst.numel > 0 && dst.data == nullptr) throw std::invalid_argument("dst: null pointer");
  require_finite_weight(weight, "weight");
  bool ok = true;
  auto with_index = [&](auto itag) {
    using I = decltype(itag);
    dispatch_float(value_dtype, "values", [&](auto vtag) {
      using V = decltype(vtag);
      dispatch_float(dst.dtype, "dst", [&](auto dtag) {
        using D = decltype(dtag);
        ok = merge_sparse_typed<I, V, D>(dst, static_cast<const I*>(indices),
                                         static_cast<const V*>(values), nnz, weight);
      });
    });
  };
  if (index_dtype == DType::kInt32) with_index(int32_t{});
  else if (index_dtype == DType::kInt64) with_index(int64_t{});
  else
    throw std::invalid_argument(std::string("indices: unsupported dtype ") +
                                dtype_name(index_dtype) + " (expected int32 or int64)");
  return ok;
}

void weighted_sum(const TensorList& out, const std::vector<TensorList>& inputs,
                  const std::vector<float>& weights) {
  check_weighted_sum(out, inputs, weights);
  if (inputs.empty()) {
    check_same_shape(out, out, "out", "out");
    dispatch_float(out.dtype, "out", [&](auto otag) {
      using O = decltype(otag);
      for_each_chunk(out.numels, [&](int32_t t, int64_t b, int64_t e) {
        O* o = static_cast<O*>(out.ptrs[t]);
        for (int64_t j = b; j < e; ++j) store(o, j, 0.0f);
      });
    });
    return;
  }
  const size_t K = inputs.size();
  const bool stream = total(out.numels) * dtype_size(out.dtype) >= kStreamBytes;
  dispatch_float(out.dtype, "out", [&](auto otag) {
    using O = decltype(otag);
    dispatch_float(inputs[0].dtype, "inputs", [&](auto itag) {
      using I = decltype(itag);
      for_each_chunk(out.numels, [&](int32_t t, int64_t b, int64_t e) {
        // Accumulate a cache-resident fp32 block, up to four inputs per pass:
        // fewer passes over acc, and few enough concurrent streams for the
        // hardware prefetchers (one input at a time fell off a cliff at K=4).
        float acc[kBlock];
        O* o = static_cast<O*>(out.ptrs[t]);
        for (int64_t bb = b; bb < e; bb += kBlock) {
          const int64_t m = std::min(kBlock, e - bb);
          for (size_t k = 0; k < K; k += 4) {
            const I* x[4];
            const size_t g = std::min<size_t>(4, K - k);
            for (size_t i = 0; i < g; ++i) x[i] = static_cast<const I*>(inputs[k + i].ptrs[t]) + bb;
            accumulate_group(acc, x, &weights[k], g, k == 0, m);
          }
          store_block(o + bb, acc, m, stream);
        }
        if (stream) stream_fence();
      });
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

#if !defined(__FLT16_MAX__)
float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_f32(sign);
    // Subnormal half: renormalise.
    exp = 127 - 15 + 1;
    while (!(man & 0x400u)) { man <<= 1; --exp; }
    man &= 0x3ffu;
    return bits_f32(sign | (exp << 23) | (man << 13));
  }
  return bits_f32(sign | ((exp + 127 - 15) << 23) | (man << 13));
}
uint16_t float_to_half(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: Inf
  if (a < 0x38800000u) {                         // subnormal or zero in half
    const float scaled = bits_f32(a) * 16777216.0f;  // * 2^24: exact
    return sign | uint16_t(static_cast<uint32_t>(__builtin_rintf(scaled)));
  }
  const uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - ((127u - 15u) << 23);
  return sign | uint16_t(r >> 13);
}
#endif

}  // namespace ashl::cpu
