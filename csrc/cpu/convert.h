// Storage types and fp32 load/store for the CPU driver of the ops (ashl/ops.h).
// The 16-bit types are raw bits: an op reads them through a block widened by
// halves() and writes them through a block narrowed by it (vectorised for this
// CPU, chosen at run time); the scalar load/store serve the sparse scatter.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "ashl/ops.h"
#include "halves.h"

namespace ashl::cpu {

struct BF16 { uint16_t bits; };
struct F16 { uint16_t bits; };

// The host's storage types, for dispatch_float<HostStorage> (ashl/ops.h).
struct HostStorage {
  using f16 = F16;
  using bf16 = BF16;
};

template <class T>
constexpr bool is_half = std::is_same_v<T, F16> || std::is_same_v<T, BF16>;

inline float load(const float* p, int64_t i) { return p[i]; }
inline void store(float* p, int64_t i, float v) { p[i] = v; }
inline float load(const BF16* p, int64_t i) { return bf16_bits_to_float(p[i].bits); }
inline void store(BF16* p, int64_t i, float v) { p[i].bits = float_to_bf16_bits(v); }
inline float load(const F16* p, int64_t i) { return half_bits_to_float(p[i].bits); }
inline void store(F16* p, int64_t i, float v) { p[i].bits = float_to_half_bits(v); }

// m elements of a 16-bit operand as fp32, into dst.
inline void widen(float* dst, const F16* src, int64_t m) {
  halves().widen_f16(dst, reinterpret_cast<const uint16_t*>(src), m);
}
inline void widen(float* dst, const BF16* src, int64_t m) {
  halves().widen_bf16(dst, reinterpret_cast<const uint16_t*>(src), m);
}

// Elements [b, b + m) of x as fp32: x itself, or widened into tmp.
template <class T>
inline const float* fp32_block(const T* x, int64_t b, int64_t m, float* tmp) {
  if constexpr (std::is_same_v<T, float>) {
    (void)m; (void)tmp;
    return x + b;
  } else {
    widen(tmp, x + b, m);
    return tmp;
  }
}

// ops::nonfinite of a stored value. fp16 tests the stored exponent bits
// instead (all set iff NaN/Inf, as after widening): the guard runs over every
// element of a merge and needs no conversion.
template <class T>
inline bool nonfinite(const T* p, int64_t i) { return ops::nonfinite(load(p, i)); }
inline bool nonfinite(const F16* p, int64_t i) {
  uint16_t u;
  std::memcpy(&u, p + i, 2);
  return (u & 0x7c00u) == 0x7c00u;
}

// Writes m fp32 values from a cache-resident block to dst. With `stream`, they
// go out through non-temporal stores (16-bit ones as narrowed, from the
// registers): a destination too large for the cache then costs one write
// instead of a read-for-ownership plus a write.
inline void store_block(F16* dst, const float* src, int64_t m, bool stream) {
  halves().narrow_f16(reinterpret_cast<uint16_t*>(dst), src, m, stream);
}
inline void store_block(BF16* dst, const float* src, int64_t m, bool stream) {
  halves().narrow_bf16(reinterpret_cast<uint16_t*>(dst), src, m, stream);
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
// The fp32 lanes of one 256-bit vector: the group map's register-sized step.
constexpr int64_t kLanes = 8;

// True if dst can take store_lanes(dst, ..., true): 32-byte aligned.
inline bool lane_aligned(const float* dst) {
  return (reinterpret_cast<uintptr_t>(dst) & (kLanes * sizeof(float) - 1)) == 0;
}

// Stores kLanes fp32 values just computed (v stays in a register once
// inlined). With `stream` (dst lane_aligned): a non-temporal store straight
// from the register, so a destination too large for the cache costs one
// write, not a read-for-ownership plus a write.
__attribute__((always_inline)) inline void store_lanes(float* dst, const float* v, bool stream) {
#if defined(__AVX__)
  const __m256 x = _mm256_loadu_ps(v);
  if (stream) _mm256_stream_ps(dst, x);
  else _mm256_storeu_ps(dst, x);
#else
  (void)stream;
  std::memcpy(dst, v, kLanes * sizeof(float));
#endif
}

// Orders this thread's streaming stores before anything that follows. On any
// x86 build: the 16-bit narrowings stream through their run-time-chosen paths
// even where this file was compiled without AVX.
inline void stream_fence() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_sfence();
#endif
}

}  // namespace ashl::cpu
