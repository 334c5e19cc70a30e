// Validation shared by the CPU and CUDA back ends.
#include "ashl/kernels.h"

#include <algorithm>
#include <string>

namespace ashl {

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "unknown";
}

int64_t dtype_size(DType d) {
  switch (d) {
    case DType::kFloat32: case DType::kInt32: return 4;
    case DType::kFloat16: case DType::kBFloat16: return 2;
    case DType::kInt64: return 8;
  }
  throw std::invalid_argument("unknown dtype code " + std::to_string(static_cast<int>(d)));
}

bool is_float(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16;
}

static void check_list(const TensorList& l, const char* name) {
  if (l.ptrs.size() != l.numels.size())
    throw std::invalid_argument(std::string(name) + ": " + std::to_string(l.ptrs.size()) +
                                " pointers but " + std::to_string(l.numels.size()) + " sizes");
  for (size_t i = 0; i < l.ptrs.size(); ++i) {
    if (l.numels[i] < 0)
      throw std::invalid_argument(std::string(name) + "[" + std::to_string(i) +
                                  "]: negative size " + std::to_string(l.numels[i]));
    if (l.numels[i] > 0 && l.ptrs[i] == nullptr)
      throw std::invalid_argument(std::string(name) + "[" + std::to_string(i) +
                                  "]: null pointer with " + std::to_string(l.numels[i]) +
                                  " elements");
  }
}

void check_layout(const TensorList& shape, const std::vector<int64_t>& offsets,
                  int64_t flat_numel) {
  check_list(shape, "tensors");
  if (offsets.size() != shape.numels.size())
    throw std::invalid_argument("offsets: " + std::to_string(offsets.size()) + " offsets for " +
                                std::to_string(shape.numels.size()) + " tensors");
  if (flat_numel < 0) throw std::invalid_argument("flat buffer: negative size");
  for (size_t i = 0; i < offsets.size(); ++i) {
    const int64_t off = offsets[i], n = shape.numels[i];
    // Written so that no intermediate overflows: off <= flat_numel - n.
    if (off < 0 || n > flat_numel || off > flat_numel - n)
      throw std::invalid_argument("tensor " + std::to_string(i) + " (" + std::to_string(n) +
                                  " elements at offset " + std::to_string(off) +
                                  ") does not fit in the flat buffer of " +
                                  std::to_string(flat_numel) + " elements");
  }
}

void check_same_shape(const TensorList& ref, const TensorList& other, const char* ref_name,
                      const char* other_name) {
  check_list(ref, ref_name);
  check_list(other, other_name);
  if (ref.numels.size() != other.numels.size())
    throw std::invalid_argument(std::string(other_name) + " has " +
                                std::to_string(other.numels.size()) + " tensors but " + ref_name +
                                " has " + std::to_string(ref.numels.size()));
  for (size_t i = 0; i < ref.numels.size(); ++i)
    if (ref.numels[i] != other.numels[i])
      throw std::invalid_argument(std::string(other_name) + "[" + std::to_string(i) + "] has " +
                                  std::to_string(other.numels[i]) + " elements but " + ref_name +
                                  "[" + std::to_string(i) + "] has " +
                                  std::to_string(ref.numels[i]));
}

void require_float(DType d, const char* what) {
  if (!is_float(d))
    throw std::invalid_argument(std::string(what) + ": unsupported dtype " + dtype_name(d) +
                                " (expected float32, float16 or bfloat16)");
}

void require_index(DType d, const char* what) {
  if (d != DType::kInt32 && d != DType::kInt64)
    throw std::invalid_argument(std::string(what) + ": unsupported dtype " + dtype_name(d) +
                                " (expected int32 or int64)");
}

void require_same_dtype(const TensorList& ref, const TensorList& other, const char* ref_name,
                        const char* other_name) {
  if (ref.dtype != other.dtype)
    throw std::invalid_argument(std::string(other_name) + " are " + dtype_name(other.dtype) +
                                " but " + ref_name + " are " + dtype_name(ref.dtype));
}

void require_finite_weight(float w, const std::string& what) {
  if (!(w - w == 0.0f)) throw std::invalid_argument(what + " is not finite");
}

void check_pack_delta(const TensorList& params, const TensorList& anchors,
                      const TensorList* residuals, const std::vector<int64_t>& offsets,
                      const Flat& out, float scale) {
  check_same_shape(params, anchors, "params", "anchors");
  require_same_dtype(params, anchors, "params", "anchors");
  if (residuals) {
    check_same_shape(params, *residuals, "params", "residuals");
    require_same_dtype(params, *residuals, "params", "residuals");
  }
  check_layout(params, offsets, out.numel);
  require_finite_weight(scale, "scale");
  require_float(params.dtype, "params");
  require_float(out.dtype, "out");
}

void check_unpack(const TensorList& params, const TensorList& anchors,
                  const std::vector<int64_t>& offsets, const Flat& flat) {
  check_same_shape(params, anchors, "params", "anchors");
  require_same_dtype(params, anchors, "params", "anchors");
  check_layout(params, offsets, flat.numel);
  require_float(params.dtype, "params");
  require_float(flat.dtype, "flat");
}

void check_merge_dense(const TensorList& dst, const TensorList& delta, float weight,
                       const TensorList* out) {
  check_same_shape(dst, delta, "dst", "delta");
  require_finite_weight(weight, "weight");
  require_float(dst.dtype, "dst");
  require_float(delta.dtype, "delta");
  if (out == nullptr) return;
  check_same_shape(dst, *out, "dst", "out");
  require_same_dtype(dst, *out, "dst", "out");
  // out is written before every delta element is checked: no byte of it may be dst's
  require_disjoint(*out, dst, "out", "dst");
}

void require_disjoint(const TensorList& a, const TensorList& b, const char* a_name,
                      const char* b_name) {
  struct Range {
    uintptr_t lo, hi;
    size_t index;
    int list;  // 0: a, 1: b
  };
  std::vector<Range> ranges;
  const auto add = [&](const TensorList& l, int which) {
    const auto size = static_cast<uintptr_t>(dtype_size(l.dtype));
    for (size_t i = 0; i < l.ptrs.size(); ++i)
      if (l.numels[i] > 0) {
        const auto lo = reinterpret_cast<uintptr_t>(l.ptrs[i]);
        ranges.push_back({lo, lo + static_cast<uintptr_t>(l.numels[i]) * size, i, which});
      }
  };
  add(a, 0);
  add(b, 1);
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& x, const Range& y) { return x.lo < y.lo; });
  // Sorted by start: a range overlaps the other list iff that list's furthest-reaching
  // range so far ends past its start.
  const Range* reach[2] = {nullptr, nullptr};
  for (const Range& r : ranges) {
    const Range* other = reach[1 - r.list];
    if (other != nullptr && other->hi > r.lo) {
      const Range& x = r.list == 0 ? r : *other;
      const Range& y = r.list == 0 ? *other : r;
      throw std::invalid_argument(std::string(a_name) + "[" + std::to_string(x.index) +
                                  "] overlaps " + b_name + "[" + std::to_string(y.index) +
                                  "]: merge in place without out");
    }
    if (reach[r.list] == nullptr || r.hi > reach[r.list]->hi) reach[r.list] = &r;
  }
}

void check_merge_sparse(const Flat& dst, const void* indices, DType index_dtype,
                        const void* values, DType value_dtype, int64_t nnz, float weight) {
  if (nnz < 0) throw std::invalid_argument("nnz is negative");
  if (nnz > 0 && (indices == nullptr || values == nullptr))
    throw std::invalid_argument("indices/values: null pointer");
  if (dst.numel < 0) throw std::invalid_argument("dst: negative size");
  if (dst.numel > 0 && dst.data == nullptr) throw std::invalid_argument("dst: null pointer");
  require_finite_weight(weight, "weight");
  require_index(index_dtype, "indices");
  require_float(value_dtype, "values");
  require_float(dst.dtype, "dst");
}

void check_weighted_sum(const TensorList& out, const std::vector<TensorList>& inputs,
                        const std::vector<float>& weights) {
  if (inputs.size() != weights.size())
    throw std::invalid_argument(std::to_string(inputs.size()) + " inputs but " +
                                std::to_string(weights.size()) + " weights");
  for (size_t k = 0; k < inputs.size(); ++k) {
    const std::string name = "inputs[" + std::to_string(k) + "]";
    check_same_shape(out, inputs[k], "out", name.c_str());
    if (inputs[k].dtype != inputs[0].dtype)
      throw std::invalid_argument(name + " is " + dtype_name(inputs[k].dtype) +
                                  " but inputs[0] is " + dtype_name(inputs[0].dtype));
    require_finite_weight(weights[k], "weights[" + std::to_string(k) + "]");
  }
  if (inputs.empty()) check_same_shape(out, out, "out", "out");
  require_float(out.dtype, "out");
  if (!inputs.empty()) require_float(inputs[0].dtype, "inputs");
}

}  // namespace ashl
