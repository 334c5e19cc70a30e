// ashl's fused multi-tensor kernels: the framework-agnostic interface.
//
// Nothing here knows about torch. Callers hand over raw pointers, element
// counts, dtypes and offsets into flat buffers after validating the tensors
// (see src/ashl/kernels.py); every function still checks the bounds it can
// check (list lengths, offsets, flat sizes, sparse indices) and throws instead
// of touching memory it was not given.
//
// Arithmetic is always fp32, whatever the storage dtype. A non-finite scale or
// weight throws std::invalid_argument.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace ashl {

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kInt32 = 3, kInt64 = 4 };

const char* dtype_name(DType d);
int64_t dtype_size(DType d);
bool is_float(DType d);

// A list of same-dtype tensors, each a contiguous run of `numels[i]` elements
// at `ptrs[i]`. Where a flat buffer is involved, a separate `offsets` argument
// places tensor i at element offsets[i] of it.
struct TensorList {
  DType dtype = DType::kFloat32;
  std::vector<void*> ptrs;
  std::vector<int64_t> numels;
};

// A contiguous flat buffer.
struct Flat {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t numel = 0;
};

// Execution context for CUDA (ignored on CPU).
struct CudaContext {
  void* stream = nullptr;      // cudaStream_t; nullptr = default stream
  // Device memory for int32 flags: merge_dense uses 1, merge_sparse 2
  // (ashl.kernels passes 4). Each call zeroes the flags it uses on `stream`
  // first. May be null for the other kernels and for calls with no work.
  int32_t* scratch = nullptr;
};

// Throws std::invalid_argument unless `offsets` places every tensor of `shape`
// inside a flat buffer of `flat_numel` elements.
void check_layout(const TensorList& shape, const std::vector<int64_t>& offsets, int64_t flat_numel);
// Throws std::invalid_argument unless `other` has the same count and numels as `ref`.
void check_same_shape(const TensorList& ref, const TensorList& other, const char* ref_name,
                      const char* other_name);
void require_float(DType d, const char* what);
void require_index(DType d, const char* what);  // int32 or int64
void require_same_dtype(const TensorList& ref, const TensorList& other, const char* ref_name,
                        const char* other_name);
void require_finite_weight(float w, const std::string& what);
// Everything both back ends check before running each kernel (the indices of
// merge_sparse are checked by the kernel itself, before it writes anything).
void check_pack_delta(const TensorList& params, const TensorList& anchors,
                      const TensorList* residuals, const std::vector<int64_t>& offsets,
                      const Flat& out, float scale);
void check_unpack(const TensorList& params, const TensorList& anchors,
                  const std::vector<int64_t>& offsets, const Flat& flat);
void check_merge_dense(const TensorList& dst, const TensorList& delta, float weight,
                       const TensorList* out);
// Throws std::invalid_argument naming the first pair if any tensor of `a` shares a byte
// with a tensor of `b`.
void require_disjoint(const TensorList& a, const TensorList& b, const char* a_name,
                      const char* b_name);
void check_merge_sparse(const Flat& dst, const void* indices, DType index_dtype,
                        const void* values, DType value_dtype, int64_t nnz, float weight);
void check_weighted_sum(const TensorList& out, const std::vector<TensorList>& inputs,
                        const std::vector<float>& weights);

namespace cpu {
// out[offsets[i] + j] = scale * (params[i][j] - anchors[i][j]) (+ residuals[i][j])
void pack_delta(const TensorList& params, const TensorList& anchors, const TensorList* residuals,
                const std::vector<int64_t>& offsets, Flat out, float scale);
// params[i][j] = anchors[i][j] = flat[offsets[i] + j]
void unpack_assign(const TensorList& params, const TensorList& anchors,
                   const std::vector<int64_t>& offsets, Flat flat);
// anchors[i][j] += flat[offsets[i] + j]; params[i][j] = anchors[i][j]
void unpack_add(const TensorList& params, const TensorList& anchors,
                const std::vector<int64_t>& offsets, Flat flat);
// dst[i] += weight * delta[i] for every tensor, unless any delta element is
// NaN/Inf: then nothing is written and it returns false. With `out` (shaped and
// typed like dst, sharing no byte with it), out[i] = dst[i] + weight * delta[i]
// and dst is only read: one pass over every operand; on false dst is untouched
// and out holds garbage.
bool merge_dense(const TensorList& dst, const TensorList& delta, float weight,
                 const TensorList* out = nullptr);
// dst[indices[k]] += weight * values[k]. An index outside [0, dst.numel)
// throws std::out_of_range (checked before values, so it wins over a
// non-finite value) and a non-finite value returns false; either way nothing
// is written. Duplicate indices accumulate.
bool merge_sparse(Flat dst, const void* indices, DType index_dtype, const void* values,
                  DType value_dtype, int64_t nnz, float weight);
// out[i] = sum_k weights[k] * inputs[k][i]; zero inputs write zeros. All inputs
// share one dtype. out may alias inputs[k] only for k < 8 (CUDA re-reads out
// as the running sum beyond 8 inputs).
void weighted_sum(const TensorList& out, const std::vector<TensorList>& inputs,
                  const std::vector<float>& weights);

int max_threads();
void set_num_threads(int n);
}  // namespace cpu

namespace cuda {
// Same contracts as ashl::cpu, on device pointers of the current device,
// enqueued on ctx.stream. merge_dense/merge_sparse synchronise the stream to
// return their result.
bool available();  // compiled with CUDA and a device is present
void pack_delta(const TensorList& params, const TensorList& anchors, const TensorList* residuals,
                const std::vector<int64_t>& offsets, Flat out, float scale, CudaContext ctx);
void unpack_assign(const TensorList& params, const TensorList& anchors,
                   const std::vector<int64_t>& offsets, Flat flat, CudaContext ctx);
void unpack_add(const TensorList& params, const TensorList& anchors,
                const std::vector<int64_t>& offsets, Flat flat, CudaContext ctx);
bool merge_dense(const TensorList& dst, const TensorList& delta, float weight,
                 const TensorList* out, CudaContext ctx);
bool merge_sparse(Flat dst, const void* indices, DType index_dtype, const void* values,
                  DType value_dtype, int64_t nnz, float weight, CudaContext ctx);
void weighted_sum(const TensorList& out, const std::vector<TensorList>& inputs,
                  const std::vector<float>& weights, CudaContext ctx);
}  // namespace cuda

}  // namespace ashl
