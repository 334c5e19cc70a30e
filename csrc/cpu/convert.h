// Storage types and fp32 load/store for the CPU driver of the ops (ashl/ops.h).
// Written branch-free so the compiler vectorises the inner loops (bf16 via bit
// operations, fp16 via _Float16 which becomes vcvtph2ps/vcvtps2ph where F16C is
// available).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "ashl/ops.h"

namespace ashl::cpu {

struct BF16 { uint16_t bits; };
#if defined(__FLT16_MAX__)
using F16 = _Float16;
#else
struct F16 { uint16_t bits; };
#endif

// The host's storage types, for dispatch_float<HostStorage> (ashl/ops.h).
struct HostStorage {
  using f16 = F16;
  using bf16 = BF16;
};

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float load(const float* p, int64_t i) { return p[i]; }
inline void store(float* p, int64_t i, float v) { p[i] = v; }

inline float load(const BF16* p, int64_t i) { return bits_f32(uint32_t(p[i].bits) << 16); }
inline void store(BF16* p, int64_t i, float v) {
  // Round to nearest even, as torch does; NaN stays a (quiet) NaN.
  const uint32_t u = f32_bits(v);
  const uint16_t rounded = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  const uint16_t quiet_nan = uint16_t((u >> 16) | 0x40u);
  p[i].bits = ((u & 0x7fffffffu) > 0x7f800000u) ? quiet_nan : rounded;
}

#if defined(__FLT16_MAX__)
inline float load(const F16* p, int64_t i) { return static_cast<float>(p[i]); }
inline void store(F16* p, int64_t i, float v) { p[i] = static_cast<F16>(v); }
#else
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
inline float load(const F16* p, int64_t i) { return half_to_float(p[i].bits); }
inline void store(F16* p, int64_t i, float v) { p[i].bits = float_to_half(v); }
#endif

// ops::nonfinite of a stored value. fp16 tests the stored exponent bits
// instead (all set iff NaN/Inf, as after widening): GCC does not vectorise
// the _Float16 widening, and this runs over every element of a merge.
template <class T>
inline bool nonfinite(const T* p, int64_t i) { return ops::nonfinite(load(p, i)); }
inline bool nonfinite(const F16* p, int64_t i) {
  uint16_t u;
  std::memcpy(&u, p + i, 2);
  return (u & 0x7c00u) == 0x7c00u;
}

// Writes m fp32 values from a cache-resident block to dst. With `stream`, fp32
// goes out through non-temporal stores: a destination too large for the cache
// then costs one write instead of a read-for-ownership plus a write.
template <class F>
inline void store_block(F* dst, const float* src, int64_t m, bool /*stream*/) {
#pragma omp simd
  for (int64_t j = 0; j < m; ++j) store(dst, j, src[j]);
}
inline void store_block(F16* dst, const float* src, int64_t m, bool /*stream*/) {
  int64_t j = 0;
#if defined(__F16C__)
  // GCC does not vectorise the narrowing to _Float16 (a scalar loop of
  // vcvtps2ph); 8 at a time round to nearest even just the same.
  for (; j + 8 <= m; j += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; j < m; ++j) store(dst, j, src[j]);
}
inline void store_block(float* dst, const float* src, int64_t m, bool stream) {
#if defined(__AVX__)
  if (stream) {
    int64_t j = 0;
    for (; j < m && (reinterpret_cast<uintptr_t>(dst + j) & 31u); ++j) dst[j] = src[j];
    for (; j + 8 <= m; j += 8) _mm256_stream_ps(dst + j, _mm256_loadu_ps(src + j));
    for (; j < m; ++j) dst[j] = src[j];
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, src, static_cast<size_t>(m) * sizeof(float));
}
// Orders this thread's streaming stores before anything that follows.
inline void stream_fence() {
#if defined(__AVX__)
  _mm_sfence();
#endif
}

}  // namespace ashl::cpu
