// CUDA back end: the multi_tensor_apply driver of the ops in ashl/ops.h (one
// launch for many tensors). Storage is fp32/fp16/bf16, arithmetic is fp32.
#include <string>

#include "ashl/kernels.h"
#include "multi_tensor_apply.cuh"

namespace ashl::cuda {
namespace {

using namespace detail;

int32_t* require_scratch(const CudaContext& ctx, const char* what) {
  if (ctx.scratch == nullptr)
    throw std::invalid_argument(std::string(what) + ": CudaContext.scratch is null");
  return ctx.scratch;
}

int64_t total(const std::vector<int64_t>& numels) {
  int64_t n = 0;
  for (int64_t x : numels) n += x;
  return n;
}

cudaStream_t stream_of(const CudaContext& ctx) { return static_cast<cudaStream_t>(ctx.stream); }

// ---- the elementwise functor (the CPU's counterpart: map in csrc/cpu) -------
// Roles are per op; ptrs[r] points at tensor element 0 of role r.

// Role R read as storage type T.
template <int R, typename T>
struct In {
  static constexpr int kRole = R;
  using type = T;
};
// Roles R... written as storage type T, each with the op's result.
template <typename T, int... R>
struct Out {};

template <int V>
struct Lanes {
  float v[V];
};

template <int V, class Arg>
ASHL_HD Lanes<V> load_lanes(void* const* ptrs, int64_t i) {
  Lanes<V> r;
  load<V>(r.v, static_cast<const typename Arg::type*>(ptrs[Arg::kRole]) + i);
  return r;
}

template <class Op, class Outs, class... Ins>
struct Map;

// Every output role = op(input roles...), V elements at a time. All inputs
// are read before any output is written, so a role may be both (in place);
// all outputs get the same rounded value (unpack: params and anchors match).
// Blocks do nothing once *flag is set (merge_dense after its check; null: never).
template <class Op, typename O, int... R, class... Ins>
struct Map<Op, Out<O, R...>, Ins...> {
  static constexpr int kVec = vec_for<O, typename Ins::type...>();
  Op op;
  const int32_t* flag = nullptr;
  ASHL_HD bool skip() const { return flag != nullptr && flag_set(flag); }
  template <int V>
  ASHL_HD void apply(void* const* ptrs, int64_t i) const {
    lanes<V>(ptrs, i, load_lanes<V, Ins>(ptrs, i)...);
  }
  template <int V, class... L>
  ASHL_HD void lanes(void* const* ptrs, int64_t i, const L&... x) const {
    float o[V];
    ASHL_UNROLL
    for (int j = 0; j < V; ++j) o[j] = op(x.v[j]...);
    (store<V>(static_cast<O*>(ptrs[R]) + i, o), ...);
  }
};

// 0 delta. Raises *flag on any NaN/Inf; blocks starting after it is raised skip.
template <typename X>
struct FiniteCheckOp {
  static constexpr int kVec = vec_for<X>();
  int32_t* flag;
  ASHL_HD bool skip() const { return flag_set(flag); }
  template <int V>
  ASHL_HD void apply(void* const* ptrs, int64_t i) const {
    float x[V];
    load<V>(x, static_cast<const X*>(ptrs[0]) + i);
    bool bad = false;
    ASHL_UNROLL
    for (int j = 0; j < V; ++j) bad |= ops::nonfinite(x[j]);
    if (bad) *static_cast<volatile int32_t*>(flag) = 1;  // benign race: all write 1
  }
};

// Inputs per weighted_sum launch; more are handled in further passes.
constexpr int kMaxInputs = 8;

// 0 out, 1..kMaxInputs inputs (the first `count` are set). out = sum_k w[k] *
// in_k, added to out itself when `accumulate` (passes after the first).
template <typename O, typename I>
struct WeightedSumOp {
  static constexpr int kVec = vec_for<O, I>();
  float w[kMaxInputs];
  int count;
  int accumulate;
  ASHL_HD bool skip() const { return false; }
  template <int V>
  ASHL_HD void apply(void* const* ptrs, int64_t i) const {
    float acc[V];
    if (accumulate) {
      load<V>(acc, static_cast<const O*>(ptrs[0]) + i);
    } else {
      ASHL_UNROLL
      for (int j = 0; j < V; ++j) acc[j] = 0.0f;  // stays only when count == 0
    }
    ASHL_UNROLL
    for (int k = 0; k < kMaxInputs; ++k) {
      if (k < count) {
        float x[V];
        load<V>(x, static_cast<const I*>(ptrs[1 + k]) + i);
        const ops::AddScaled op{w[k]};
        const bool first = k == 0 && !accumulate;
        ASHL_UNROLL
        for (int j = 0; j < V; ++j) acc[j] = first ? op.term(x[j]) : op(acc[j], x[j]);
      }
    }
    store<V>(static_cast<O*>(ptrs[0]) + i, acc);
  }
};

// ---- sparse merge -----------------------------------------------------------

constexpr int kSparseThreads = 256;
constexpr int64_t kSparseMaxBlocks = 8192;

// flags[0]: a value is NaN/Inf. flags[1]: INT32_MAX - (first bad position),
// 0 if none; atomicMax on it keeps the smallest position (clamped to
// INT32_MAX - 1), and zeroing initialises it.
template <typename I, typename V>
struct SparseCheck {
  const I* idx;
  const V* val;
  int64_t nnz, n;
  int32_t* flags;
  ASHL_HD void operator()(int block, int thread, int blocks, int threads) const {
    const int64_t stride = static_cast<int64_t>(blocks) * threads;
    for (int64_t k = static_cast<int64_t>(block) * threads + thread; k < nnz; k += stride) {
      const int64_t i = static_cast<int64_t>(idx[k]);
      if (i < 0 || i >= n) {
        const int64_t pos = k < INT32_MAX - 1 ? k : INT32_MAX - 1;
        atomic_max_i32(&flags[1], static_cast<int32_t>(INT32_MAX - pos));
      }
      if (ops::nonfinite(to_f(val[k]))) *static_cast<volatile int32_t*>(&flags[0]) = 1;
    }
  }
};

ASHL_HD unsigned short to_bits(__half x) { return __half_as_ushort(x); }
ASHL_HD unsigned short to_bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
ASHL_HD void from_bits(__half* x, unsigned short b) { *x = __ushort_as_half(b); }
ASHL_HD void from_bits(__nv_bfloat16* x, unsigned short b) { *x = __ushort_as_bfloat16(b); }

// *addr = op(*addr, x), atomically. fp32: atomicAdd adds op.term(x), which
// is op's own addition. 16-bit floats: a CAS loop, so the update is done in
// fp32 and rounded once, as on the CPU (native half/bf16 atomicAdd would round
// op.term(x) to 16 bits first, and could overflow on it).
ASHL_HD void atomic_update(float* addr, const ops::AddScaled& op, float x) {
  atomic_add_f32(addr, op.term(x));
}
template <typename T>
ASHL_HD void atomic_update(T* addr, const ops::AddScaled& op, float x) {
  unsigned short* word = reinterpret_cast<unsigned short*>(addr);
  unsigned short old = *word, assumed;
  do {
    assumed = old;
    T cur;
    from_bits(&cur, assumed);
    old = atomic_cas_u16(word, assumed, to_bits(from_f<T>(op(to_f(cur), x))));
  } while (old != assumed);  // integer compare: terminates even on NaN
}

// Scatter-add; does nothing if the check kernel raised either flag.
template <typename I, typename V, typename D>
struct SparseScatter {
  D* dst;
  const I* idx;
  const V* val;
  int64_t nnz;
  ops::AddScaled op;
  const int32_t* flags;
  ASHL_HD void operator()(int block, int thread, int blocks, int threads) const {
    if (flag_set(&flags[0]) || flag_set(&flags[1])) return;
    const int64_t stride = static_cast<int64_t>(blocks) * threads;
    for (int64_t k = static_cast<int64_t>(block) * threads + thread; k < nnz; k += stride)
      atomic_update(dst + static_cast<int64_t>(idx[k]), op, to_f(val[k]));
  }
};

// Enqueues the check and the scatter, then reads the flags back: throws on
// an index out of range, returns false on a non-finite value.
template <typename I, typename V, typename D>
bool merge_sparse_typed(Tag<I>, Tag<V>, Tag<D>, Flat dst, const void* indices, const void* values,
                        int64_t nnz, float weight, int32_t* flags, cudaStream_t s) {
  const I* idx = static_cast<const I*>(indices);
  const V* val = static_cast<const V*>(values);
  const int blocks = static_cast<int>(
      std::min<int64_t>((nnz + kSparseThreads - 1) / kSparseThreads, kSparseMaxBlocks));
  zero_async(flags, 2 * sizeof(int32_t), s);
  launch(blocks, kSparseThreads, s, SparseCheck<I, V>{idx, val, nnz, dst.numel, flags},
         "merge_sparse check");
  launch(blocks, kSparseThreads, s,
         SparseScatter<I, V, D>{static_cast<D*>(dst.data), idx, val, nnz, {weight}, flags},
         "merge_sparse scatter");
  int32_t h[2] = {0, 0};
  read_back(h, flags, sizeof(h), s);
  if (h[1] != 0) {
    const int64_t pos = INT32_MAX - static_cast<int64_t>(h[1]);
    I bad = 0;
    read_back(&bad, idx + pos, sizeof(I), s);
    // pos == INT32_MAX - 1 may be a clamped later position: then say so.
    const bool clamped = pos == INT32_MAX - 1 && nnz > INT32_MAX - 1;
    throw std::out_of_range("indices[" + std::to_string(pos) + (clamped ? " or later" : "") +
                            "] = " + std::to_string(static_cast<int64_t>(bad)) +
                            " is out of range for a buffer of " + std::to_string(dst.numel) +
                            " elements");
  }
  return h[0] == 0;
}

}  // namespace

// ---- public API -------------------------------------------------------------

bool available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // don't leave the error for the next caller to find
    return false;
  }
  return n > 0;
}

void pack_delta(const TensorList& params, const TensorList& anchors, const TensorList* residuals,
                const std::vector<int64_t>& offsets, Flat out, float scale, CudaContext ctx) {
  check_pack_delta(params, anchors, residuals, offsets, out, scale);
  if (total(params.numels) == 0) return;
  // Roles: 0 out, 1 params, 2 anchors, 3 residuals. Without residuals three
  // roles, so more tensors fit in one launch.
  auto work = [&](auto& w) {
    w.set(0, out, offsets);
    w.set(1, params);
    w.set(2, anchors);
  };
  dispatch_float<DeviceStorage>(params.dtype, "params", out.dtype, "out", [&](auto pt, auto ft) {
    using P = typename decltype(pt)::type;
    using F = typename decltype(ft)::type;
    if (residuals) {
      Work<4> w(params.numels);
      work(w);
      w.set(3, *residuals);
      using Op = Map<ops::DeltaResidual, Out<F, 0>, In<1, P>, In<2, P>, In<3, P>>;
      multi_tensor_apply(w, Op{{scale}}, stream_of(ctx), "pack_delta");
    } else {
      Work<3> w(params.numels);
      work(w);
      using Op = Map<ops::Delta, Out<F, 0>, In<1, P>, In<2, P>>;
      multi_tensor_apply(w, Op{{scale}}, stream_of(ctx), "pack_delta");
    }
  });
}

namespace {
// unpack_assign / unpack_add. Roles: 0 flat, 1 params, 2 anchors; the op
// writes anchors and params.
template <typename P, typename F>
using AssignOp = Map<ops::Assign, Out<P, 2, 1>, In<0, F>>;
template <typename P, typename F>
using AddOp = Map<ops::Add, Out<P, 2, 1>, In<2, P>, In<0, F>>;

template <template <typename, typename> class Op>
void unpack(const TensorList& params, const TensorList& anchors,
            const std::vector<int64_t>& offsets, Flat flat, CudaContext ctx, const char* what) {
  check_unpack(params, anchors, offsets, flat);
  Work<3> w(params.numels);
  w.set(0, flat, offsets);
  w.set(1, params);
  w.set(2, anchors);
  if (w.total() == 0) return;
  dispatch_float<DeviceStorage>(params.dtype, "params", flat.dtype, "flat", [&](auto pt, auto ft) {
    using P = typename decltype(pt)::type;
    using F = typename decltype(ft)::type;
    multi_tensor_apply(w, Op<P, F>{}, stream_of(ctx), what);
  });
}
}  // namespace

void unpack_assign(const TensorList& params, const TensorList& anchors,
                   const std::vector<int64_t>& offsets, Flat flat, CudaContext ctx) {
  unpack<AssignOp>(params, anchors, offsets, flat, ctx, "unpack_assign");
}

void unpack_add(const TensorList& params, const TensorList& anchors,
                const std::vector<int64_t>& offsets, Flat flat, CudaContext ctx) {
  unpack<AddOp>(params, anchors, offsets, flat, ctx, "unpack_add");
}

bool merge_dense(const TensorList& dst, const TensorList& delta, float weight,
                 const TensorList* out, CudaContext ctx) {
  check_merge_dense(dst, delta, weight, out);
  Work<3> w(dst.numels);
  w.set(0, out ? *out : dst);
  w.set(1, dst);
  w.set(2, delta);
  if (w.total() == 0) return true;
  int32_t* flag = require_scratch(ctx, "merge_dense");
  const cudaStream_t s = stream_of(ctx);
  // Check everything before writing anything; the merge kernel reads the flag
  // on the device, so there is one host sync, at the end. (With `out` the merge
  // could run unchecked, but one form for both keeps the guard in one place.)
  zero_async(flag, sizeof(int32_t), s);
  dispatch_float<DeviceStorage>(dst.dtype, "dst", delta.dtype, "delta", [&](auto dt, auto xt) {
    using D = typename decltype(dt)::type;
    using X = typename decltype(xt)::type;
    Work<1> wc(delta.numels);
    wc.set(0, delta);
    multi_tensor_apply(wc, FiniteCheckOp<X>{flag}, s, "merge_dense check");
    using Op = Map<ops::AddScaled, Out<D, 0>, In<1, D>, In<2, X>>;
    multi_tensor_apply(w, Op{{weight}, flag}, s, "merge_dense");
  });
  int32_t h = 0;
  read_back(&h, flag, sizeof(h), s);
  return h == 0;
}

bool merge_sparse(Flat dst, const void* indices, DType index_dtype, const void* values,
                  DType value_dtype, int64_t nnz, float weight, CudaContext ctx) {
  check_merge_sparse(dst, indices, index_dtype, values, value_dtype, nnz, weight);
  if (nnz == 0) return true;
  int32_t* flags = require_scratch(ctx, "merge_sparse");
  bool ok = true;
  dispatch_sparse<DeviceStorage>(index_dtype, value_dtype, dst.dtype, [&](auto i, auto v, auto d) {
    ok = merge_sparse_typed(i, v, d, dst, indices, values, nnz, weight, flags, stream_of(ctx));
  });
  return ok;
}

void weighted_sum(const TensorList& out, const std::vector<TensorList>& inputs,
                  const std::vector<float>& weights, CudaContext ctx) {
  check_weighted_sum(out, inputs, weights);
  const size_t K = inputs.size();
  const DType in_dtype = K ? inputs[0].dtype : out.dtype;  // no inputs: out = 0
  // Passes after the first read `out` back as their accumulator, so `out`
  // must not be one of the inputs they read (it was overwritten by then).
  for (size_t k = kMaxInputs; k < K; ++k)
    for (size_t i = 0; i < out.ptrs.size(); ++i)
      if (out.numels[i] > 0 && inputs[k].ptrs[i] == out.ptrs[i])
        throw std::invalid_argument("weighted_sum: out aliases inputs[" + std::to_string(k) +
                                    "]; with more than " + std::to_string(kMaxInputs) +
                                    " inputs out may only alias one of the first " +
                                    std::to_string(kMaxInputs));
  if (total(out.numels) == 0) return;
  dispatch_float<DeviceStorage>(out.dtype, "out", in_dtype, "inputs", [&](auto ot, auto it) {
    using O = typename decltype(ot)::type;
    using I = typename decltype(it)::type;
    // Do-while: K == 0 still runs one pass, which writes zeros.
    size_t k0 = 0;
    do {
      const size_t k1 = std::min(K, k0 + kMaxInputs);
      Work<1 + kMaxInputs> w(out.numels);
      w.set(0, out);
      WeightedSumOp<O, I> op{};
      for (size_t k = k0; k < k1; ++k) {
        w.set(static_cast<int>(1 + k - k0), inputs[k]);
        op.w[k - k0] = weights[k];
      }
      op.count = static_cast<int>(k1 - k0);
      op.accumulate = k0 > 0;
      multi_tensor_apply(w, op, stream_of(ctx), "weighted_sum");
      k0 = k1;
    } while (k0 < K);
  });
}

}  // namespace ashl::cuda
