// Built instead of kernels.cu when nvcc is not found (ASHL_WITH_CUDA=auto) or
// CUDA is turned off: every entry point says how to get the real kernels.
#include <stdexcept>

#include "ashl/kernels.h"

namespace ashl::cuda {
namespace {
[[noreturn]] void unavailable() {
  throw std::runtime_error(
      "ashl was built without CUDA; rebuild with nvcc on PATH and ASHL_WITH_CUDA=on");
}
}  // namespace

bool available() { return false; }
void pack_delta(const TensorList&, const TensorList&, const TensorList*,
                const std::vector<int64_t>&, Flat, float, CudaContext) { unavailable(); }
void unpack_assign(const TensorList&, const TensorList&, const std::vector<int64_t>&, Flat,
                   CudaContext) { unavailable(); }
void unpack_add(const TensorList&, const TensorList&, const std::vector<int64_t>&, Flat,
                CudaContext) { unavailable(); }
bool merge_dense(const TensorList&, const TensorList&, float, const TensorList*, CudaContext) {
  unavailable();
}
bool merge_sparse(Flat, const void*, DType, const void*, DType, int64_t, float, CudaContext) {
  unavailable();
}
void weighted_sum(const TensorList&, const std::vector<TensorList>&, const std::vector<float>&,
                  CudaContext) { unavailable(); }
}  // namespace ashl::cuda
