// One launch over many tensors, in the style of apex's multi_tensor_apply.
//
// A launch covers up to Meta<N>::kTensors tensors and kBlocks (tensor, chunk)
// pairs; every block handles one 64K-element chunk of one tensor. All
// metadata (pointers, numels, the block table) travels in the kernel
// arguments, so there is no host->device copy and no device allocation. Each
// tensor has N "roles" (e.g. out, params, anchors): one pointer per role,
// already offset into a flat buffer where the role is a flat buffer.
//
// Every kernel is run_kernel<Body>: the body is a __host__ __device__ functor
// called as body(block, thread, blocks, threads). A build with
// -DASHL_CUDA_EMULATE runs each launch serially on the host instead (and the
// few runtime calls on host memory), so the index math, tails, misaligned
// paths and batching are testable without a GPU. Production builds never
// define it.
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
#error "ashl CUDA kernels need sm_70 or newer (16-bit atomicCAS)"
#endif

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "ashl/kernels.h"
#include "ashl/ops.h"

namespace ashl::cuda::detail {

constexpr int kChunk = 1 << 16;   // elements per block task
constexpr int kThreads = 512;     // threads per block
constexpr int kBlocks = 320;      // block-table entries per launch
constexpr int kArgBytes = 4096;   // kernel-argument limit before CUDA 12.1 / Volta
constexpr int kOpBytes = 256;     // reserved for the op functor's arguments

template <int N>
struct Meta {
  // As many tensors as fit in the argument budget next to the block table.
  static constexpr int kFit = (kArgBytes - kOpBytes - 8 - kBlocks * 5) / (8 * (N + 1));
  static constexpr int kTensors = kFit < 64 ? kFit : 64;
  static_assert(kTensors >= 8, "too many roles for one launch");
  void* ptr[N][kTensors];
  int64_t numel[kTensors];
  uint64_t aligned;          // bit t: every role of tensor t allows kVec-wide access
  int32_t chunk[kBlocks];    // chunk index within the tensor
  uint8_t tensor[kBlocks];   // tensor slot
};

// ---- fp32 conversion and vectorised access --------------------------------
// ASHL_HD (ashl/ops.h) is __host__ __device__ here, so that a host-only test
// can run the ops and the block mapping without a GPU.
#ifdef __CUDA_ARCH__
#define ASHL_UNROLL _Pragma("unroll")
#else
#define ASHL_UNROLL
#endif

// The device's storage types, for dispatch_float<DeviceStorage> (ashl/ops.h).
struct DeviceStorage {
  using f16 = __half;
  using bf16 = __nv_bfloat16;
};

ASHL_HD float to_f(float x) { return x; }
ASHL_HD float to_f(__half x) { return __half2float(x); }
ASHL_HD float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> ASHL_HD T from_f(float x);
template <> ASHL_HD float from_f<float>(float x) { return x; }
template <> ASHL_HD __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> ASHL_HD __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// V consecutive elements as one aligned access (16 bytes for V = 16/sizeof(T)).
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <int V, typename T>
ASHL_HD void load(float (&r)[V], const T* p) {
  const Vec<T, V> x = *reinterpret_cast<const Vec<T, V>*>(p);
  ASHL_UNROLL
  for (int j = 0; j < V; ++j) r[j] = to_f(x.v[j]);
}

template <int V, typename T>
ASHL_HD void store(T* p, const float (&r)[V]) {
  Vec<T, V> x;
  ASHL_UNROLL
  for (int j = 0; j < V; ++j) x.v[j] = from_f<T>(r[j]);
  *reinterpret_cast<Vec<T, V>*>(p) = x;
}

// Elements per vector for an op touching types T...: 16 bytes of the widest.
template <typename... T>
constexpr int vec_for() {
  size_t widest = 1;
  ((widest = sizeof(T) > widest ? sizeof(T) : widest), ...);
  return 16 / static_cast<int>(widest);
}

ASHL_HD bool flag_set(const int32_t* flag) {
  return *static_cast<const volatile int32_t*>(flag) != 0;
}

// Atomics; the host versions serve the serial emulation only.
ASHL_HD void atomic_max_i32(int32_t* a, int32_t v) {
#ifdef __CUDA_ARCH__
  atomicMax(a, v);
#else
  if (v > *a) *a = v;
#endif
}
ASHL_HD unsigned short atomic_cas_u16(unsigned short* a, unsigned short expect,
                                      unsigned short v) {
#ifdef __CUDA_ARCH__
  return atomicCAS(a, expect, v);  // 16-bit CAS: sm_70+
#else
  const unsigned short old = *a;
  if (old == expect) *a = v;
  return old;
#endif
}
ASHL_HD void atomic_add_f32(float* a, float v) {
#ifdef __CUDA_ARCH__
  atomicAdd(a, v);
#else
  *a += v;
#endif
}

// ---- the multi-tensor kernel body ---------------------------------------------

// The elements of block b: [base, base + len) of tensor slot `tensor`, the
// first vec_len of them (a multiple of V) by V-wide accesses, the rest singly.
struct Span {
  int tensor;
  int64_t base;
  int len;
  int vec_len;
};

template <int N>
ASHL_HD Span block_span(const Meta<N>& m, int b, int V) {
  Span s;
  s.tensor = m.tensor[b];
  // base is a multiple of kChunk, hence of V: aligned tensors stay aligned.
  s.base = static_cast<int64_t>(m.chunk[b]) * kChunk;
  const int64_t left = m.numel[s.tensor] - s.base;  // > 0 by construction
  s.len = left < kChunk ? static_cast<int>(left) : kChunk;
  s.vec_len = ((m.aligned >> s.tensor) & 1u) ? s.len / V * V : 0;
  return s;
}

// Op provides: kVec; bool skip() (checked once per block, e.g. a device flag);
// template <int V> apply(void* const* ptrs, int64_t i) handling elements
// [i, i + V) of the current tensor (V == Op::kVec only on aligned tensors).
template <int N, class Op>
struct MtaBody {
  Meta<N> m;
  Op op;
  ASHL_HD void operator()(int block, int thread, int, int threads) const {
    if (op.skip()) return;
    constexpr int V = Op::kVec;
    const Span s = block_span(m, block, V);
    void* p[N];
    ASHL_UNROLL
    for (int r = 0; r < N; ++r) p[r] = m.ptr[r][s.tensor];
    for (int j = thread * V; j < s.vec_len; j += threads * V) op.template apply<V>(p, s.base + j);
    for (int j = s.vec_len + thread; j < s.len; j += threads) op.template apply<1>(p, s.base + j);
  }
};

// ---- launching and runtime calls ----------------------------------------------

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("ashl cuda: ") + what + ": " + cudaGetErrorString(e));
}

template <class Body>
__global__ void __launch_bounds__(kThreads) run_kernel(const Body body) {
  body(blockIdx.x, threadIdx.x, gridDim.x, blockDim.x);
}

template <class Body>
void launch(int blocks, int threads, cudaStream_t stream, const Body& body, const char* what) {
  static_assert(sizeof(Body) <= kArgBytes, "kernel arguments exceed 4 KB");
#ifdef ASHL_CUDA_EMULATE
  (void)stream, (void)what;
  for (int b = 0; b < blocks; ++b)
    for (int t = 0; t < threads; ++t) body(b, t, blocks, threads);
#else
  run_kernel<Body><<<blocks, threads, 0, stream>>>(body);
  check(cudaGetLastError(), what);
#endif
}

inline void zero_async(void* dev, size_t bytes, cudaStream_t s) {
#ifdef ASHL_CUDA_EMULATE
  (void)s;
  std::memset(dev, 0, bytes);
#else
  check(cudaMemsetAsync(dev, 0, bytes, s), "cudaMemsetAsync");
#endif
}

// Copies device memory to the host on `s` and waits for it.
inline void read_back(void* host, const void* dev, size_t bytes, cudaStream_t s) {
#ifdef ASHL_CUDA_EMULATE
  (void)s;
  std::memcpy(host, dev, bytes);
#else
  check(cudaMemcpyAsync(host, dev, bytes, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync");
  check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
#endif
}

// ---- host side --------------------------------------------------------------

// Per-tensor pointers for each role, plus the element size of each role (for
// the alignment test). Roles left unset stay null and must not be touched by
// the op.
template <int N>
struct Work {
  std::vector<int64_t> numels;
  std::vector<std::array<void*, N>> ptrs;
  std::array<int64_t, N> esize;

  explicit Work(const std::vector<int64_t>& n) : numels(n), ptrs(n.size()) {
    for (auto& a : ptrs) a.fill(nullptr);
    esize.fill(1);
    for (int64_t x : numels)
      if (x < 0) throw std::invalid_argument("negative tensor size");
  }
  void set(int r, const TensorList& l) {
    if (l.ptrs.size() != numels.size()) throw std::invalid_argument("tensor count mismatch");
    esize[r] = dtype_size(l.dtype);
    for (size_t i = 0; i < numels.size(); ++i) {
      if (numels[i] > 0 && l.ptrs[i] == nullptr) throw std::invalid_argument("null tensor pointer");
      ptrs[i][r] = l.ptrs[i];
    }
  }
  // Role r is tensor i's slice of a flat buffer (bounds checked by check_layout).
  void set(int r, const Flat& f, const std::vector<int64_t>& offsets) {
    if (offsets.size() != numels.size()) throw std::invalid_argument("offset count mismatch");
    esize[r] = dtype_size(f.dtype);
    for (size_t i = 0; i < numels.size(); ++i) {
      if (numels[i] == 0) continue;
      if (f.data == nullptr) throw std::invalid_argument("null flat buffer");
      ptrs[i][r] = static_cast<char*>(f.data) + offsets[i] * esize[r];
    }
  }
  int64_t total() const {
    int64_t s = 0;
    for (int64_t x : numels) s += x;
    return s;
  }
};

// Packs the tensors of `w` into as few Meta tables as capacity allows and calls
// launch(meta, blocks) for each; a tensor cut by a full block table resumes
// as slot 0 of the next one. `vec` is the op's vector width (alignment test).
template <int N, class Launch>
void plan(const Work<N>& w, int vec, Launch&& launch) {
  using M = Meta<N>;
  constexpr int T = M::kTensors;
  static_assert(T <= 64, "aligned mask holds 64 tensors");
  M m;
  m.aligned = 0;
  int nt = 0, nb = 0;
  for (size_t i = 0; i < w.numels.size(); ++i) {
    const int64_t n = w.numels[i];
    if (n == 0) continue;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    if (chunks > INT32_MAX) throw std::invalid_argument("tensor too large");
    bool al = true;
    for (int r = 0; r < N; ++r) {
      m.ptr[r][nt] = w.ptrs[i][r];
      al = al && reinterpret_cast<uintptr_t>(w.ptrs[i][r]) % (vec * w.esize[r]) == 0;
    }
    m.numel[nt] = n;
    if (al) m.aligned |= uint64_t(1) << nt;
    ++nt;
    for (int64_t c = 0; c < chunks; ++c) {
      m.tensor[nb] = static_cast<uint8_t>(nt - 1);
      m.chunk[nb] = static_cast<int32_t>(c);
      ++nb;
      const bool last = c == chunks - 1;
      if (nb == kBlocks || (last && nt == T)) {
        launch(static_cast<const M&>(m), nb);
        nb = 0;
        if (last) {  // tensor done: the next table starts empty
          nt = 0;
          m.aligned = 0;
        } else {  // tensor continues: it becomes slot 0 of the next table
          const int s = nt - 1;
          for (int r = 0; r < N; ++r) m.ptr[r][0] = m.ptr[r][s];
          m.numel[0] = m.numel[s];
          m.aligned = (m.aligned >> s) & 1u;
          nt = 1;
        }
      }
    }
  }
  if (nb > 0) launch(static_cast<const M&>(m), nb);
}

// Runs Op over every element of every tensor of `w` on `stream`.
template <int N, class Op>
void multi_tensor_apply(const Work<N>& w, const Op& op, cudaStream_t stream, const char* what) {
  static_assert(kChunk % Op::kVec == 0, "chunks must keep vectors aligned");
  plan(w, Op::kVec, [&](const Meta<N>& m, int blocks) {
    launch(blocks, kThreads, stream, MtaBody<N, Op>{m, op}, what);
  });
}

}  // namespace ashl::cuda::detail
