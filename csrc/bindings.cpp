// pybind11 bindings: ashl._C.cpu and ashl._C.cuda expose the same kernels.
// Arguments arrive as raw pointers (Python ints) already validated by
// ashl.kernels; the GIL is released while a kernel runs so a server thread
// can merge while the training thread computes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ashl/kernels.h"
#include "cpu/halves.h"

namespace py = pybind11;
using ashl::CudaContext;
using ashl::DType;
using ashl::Flat;
using ashl::TensorList;

namespace {

void* as_ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

DType as_dtype(int code) {
  if (code < 0 || code > static_cast<int>(DType::kInt64))
    throw std::invalid_argument("unknown dtype code " + std::to_string(code));
  return static_cast<DType>(code);
}

TensorList make_list(int dtype, const std::vector<uintptr_t>& ptrs,
                     const std::vector<int64_t>& numels) {
  TensorList l;
  l.dtype = as_dtype(dtype);
  l.ptrs.reserve(ptrs.size());
  for (uintptr_t p : ptrs) l.ptrs.push_back(as_ptr(p));
  l.numels = numels;
  return l;
}

Flat make_flat(uintptr_t data, int dtype, int64_t numel) {
  return Flat{as_ptr(data), as_dtype(dtype), numel};
}

CudaContext make_ctx(uintptr_t stream, uintptr_t scratch) {
  return CudaContext{as_ptr(stream), static_cast<int32_t*>(as_ptr(scratch))};
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "ashl's fused multi-tensor kernels (see ashl.kernels for the Python API)";
#ifdef ASHL_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif

  py::class_<TensorList>(m, "TensorList")
      .def(py::init(&make_list), py::arg("dtype"), py::arg("ptrs"), py::arg("numels"))
      .def_property_readonly("size", [](const TensorList& l) { return l.ptrs.size(); });
  py::class_<Flat>(m, "Flat")
      .def(py::init(&make_flat), py::arg("data"), py::arg("dtype"), py::arg("numel"));

  using Offsets = std::vector<int64_t>;
  using Weights = std::vector<float>;
  using Inputs = std::vector<TensorList>;
  const auto nogil = py::call_guard<py::gil_scoped_release>();

  auto cpu = m.def_submodule("cpu", "OpenMP + SIMD kernels");
  cpu.def("pack_delta", [](const TensorList& p, const TensorList& a, const TensorList* r,
                           const Offsets& off, const Flat& out, float scale) {
    ashl::cpu::pack_delta(p, a, r, off, out, scale);
  }, nogil);
  cpu.def("unpack_assign", &ashl::cpu::unpack_assign, nogil);
  cpu.def("unpack_add", &ashl::cpu::unpack_add, nogil);
  cpu.def("merge_dense", [](const TensorList& dst, const TensorList& delta, float w,
                            const TensorList* out) {
    return ashl::cpu::merge_dense(dst, delta, w, out);
  }, nogil);
  cpu.def("merge_sparse", [](const Flat& dst, uintptr_t idx, int idx_dtype, uintptr_t val,
                             int val_dtype, int64_t nnz, float w) {
    return ashl::cpu::merge_sparse(dst, as_ptr(idx), as_dtype(idx_dtype), as_ptr(val),
                                   as_dtype(val_dtype), nnz, w);
  }, nogil);
  cpu.def("weighted_sum", [](const TensorList& out, const Inputs& in, const Weights& w) {
    ashl::cpu::weighted_sum(out, in, w);
  }, nogil);
  cpu.def("max_threads", &ashl::cpu::max_threads);
  cpu.def("set_num_threads", &ashl::cpu::set_num_threads);
  cpu.def("isa", &ashl::cpu::isa, "the instruction set of the fp16/bf16 conversions in use");
  cpu.def("set_isa", &ashl::cpu::set_isa, py::arg("name"));
  cpu.def("supported_isas", &ashl::cpu::supported_isas);

  auto cuda = m.def_submodule("cuda", "multi-tensor CUDA kernels (one launch, many tensors)");
  cuda.def("available", &ashl::cuda::available);
  cuda.def("pack_delta", [](const TensorList& p, const TensorList& a, const TensorList* r,
                            const Offsets& off, const Flat& out, float scale, uintptr_t stream,
                            uintptr_t scratch) {
    ashl::cuda::pack_delta(p, a, r, off, out, scale, make_ctx(stream, scratch));
  }, nogil);
  cuda.def("unpack_assign", [](const TensorList& p, const TensorList& a, const Offsets& off,
                               const Flat& flat, uintptr_t stream, uintptr_t scratch) {
    ashl::cuda::unpack_assign(p, a, off, flat, make_ctx(stream, scratch));
  }, nogil);
  cuda.def("unpack_add", [](const TensorList& p, const TensorList& a, const Offsets& off,
                            const Flat& flat, uintptr_t stream, uintptr_t scratch) {
    ashl::cuda::unpack_add(p, a, off, flat, make_ctx(stream, scratch));
  }, nogil);
  cuda.def("merge_dense", [](const TensorList& dst, const TensorList& delta, float w,
                             const TensorList* out, uintptr_t stream, uintptr_t scratch) {
    return ashl::cuda::merge_dense(dst, delta, w, out, make_ctx(stream, scratch));
  }, nogil);
  cuda.def("merge_sparse", [](const Flat& dst, uintptr_t idx, int idx_dtype, uintptr_t val,
                              int val_dtype, int64_t nnz, float w, uintptr_t stream,
                              uintptr_t scratch) {
    return ashl::cuda::merge_sparse(dst, as_ptr(idx), as_dtype(idx_dtype), as_ptr(val),
                                    as_dtype(val_dtype), nnz, w, make_ctx(stream, scratch));
  }, nogil);
  cuda.def("weighted_sum", [](const TensorList& out, const Inputs& in, const Weights& w,
                              uintptr_t stream, uintptr_t scratch) {
    ashl::cuda::weighted_sum(out, in, w, make_ctx(stream, scratch));
  }, nogil);
}
