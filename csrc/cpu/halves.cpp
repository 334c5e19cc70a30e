// The fp16/bf16 block conversions of halves.h: a portable path and F16C/AVX2
// and AVX-512 ones, compiled with target attributes (whatever -march says) and
// chosen at run time from what the CPU reports.
#include "halves.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ASHL_X86 1
#endif

namespace ashl::cpu {
namespace {

// ---- portable ---------------------------------------------------------------

void widen_f16_portable(float* dst, const uint16_t* src, int64_t m) {
  for (int64_t j = 0; j < m; ++j) dst[j] = half_bits_to_float(src[j]);
}
// The portable path stores normally whatever `stream` says.
void narrow_f16_portable(uint16_t* dst, const float* src, int64_t m, bool = false) {
  for (int64_t j = 0; j < m; ++j) dst[j] = float_to_half_bits(src[j]);
}
void widen_bf16_portable(float* dst, const uint16_t* src, int64_t m) {
  for (int64_t j = 0; j < m; ++j) dst[j] = bf16_bits_to_float(src[j]);
}
void narrow_bf16_portable(uint16_t* dst, const float* src, int64_t m, bool = false) {
  for (int64_t j = 0; j < m; ++j) dst[j] = float_to_bf16_bits(src[j]);
}

// Where a narrowing's vector stores start. Streamed: after the elements of dst
// before its first `bytes`-aligned one (at most m), converted one at a time. A
// 16-bit tensor at an odd address (a byte offset into a buffer) never aligns: it
// is written normally (`stream` cleared).
int64_t vector_start(const uint16_t* dst, int64_t m, uintptr_t bytes, bool& stream) {
  const uintptr_t past = reinterpret_cast<uintptr_t>(dst) & (bytes - 1);
  if (!stream || (past & 1u)) {
    stream = false;
    return 0;
  }
  return std::min<int64_t>(m, static_cast<int64_t>(((bytes - past) & (bytes - 1)) / 2));
}

constexpr HalfConverters kPortable{widen_f16_portable, narrow_f16_portable, widen_bf16_portable,
                                   narrow_bf16_portable, "portable"};

#ifdef ASHL_X86
// ---- F16C + AVX2: 8 at a time -----------------------------------------------
#define ASHL_F16C __attribute__((target("avx2,f16c")))

ASHL_F16C void widen_f16_f16c(float* dst, const uint16_t* src, int64_t m) {
  int64_t j = 0;
  for (; j + 8 <= m; j += 8)
    _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j))));
  widen_f16_portable(dst + j, src + j, m - j);
}
// 8 halves (16 bytes) to dst + j: streamed (dst + j 16-byte aligned) or not.
ASHL_F16C inline void put8(uint16_t* dst, int64_t j, __m128i v, bool stream) {
  if (stream) _mm_stream_si128(reinterpret_cast<__m128i*>(dst + j), v);
  else _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), v);
}
ASHL_F16C void narrow_f16_f16c(uint16_t* dst, const float* src, int64_t m, bool stream) {
  int64_t j = vector_start(dst, m, 16, stream);
  narrow_f16_portable(dst, src, j);
  for (; j + 8 <= m; j += 8)
    put8(dst, j, _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT), stream);
  narrow_f16_portable(dst + j, src + j, m - j);
}
ASHL_F16C void widen_bf16_avx2(float* dst, const uint16_t* src, int64_t m) {
  int64_t j = 0;
  for (; j + 8 <= m; j += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j)));
    _mm256_storeu_ps(dst + j, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  widen_bf16_portable(dst + j, src + j, m - j);
}
// float_to_bf16_bits, 8 lanes: round to nearest even, NaN -> quiet NaN.
ASHL_F16C void narrow_bf16_avx2(uint16_t* dst, const float* src, int64_t m, bool stream) {
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i quiet = _mm256_set1_epi32(0x40);
  int64_t j = vector_start(dst, m, 16, stream);
  narrow_bf16_portable(dst, src, j);
  for (; j + 8 <= m; j += 8) {
    const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src + j));
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_and_si256(hi, one)), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
    const __m256i r = _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, quiet), nan);
    // 32 -> 16 bits (every value fits): pack within lanes, then gather both lanes' halves.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    put8(dst, j, _mm256_castsi256_si128(packed), stream);
  }
  narrow_bf16_portable(dst + j, src + j, m - j);
}

constexpr HalfConverters kF16C{widen_f16_f16c, narrow_f16_f16c, widen_bf16_avx2, narrow_bf16_avx2,
                               "f16c"};

// ---- AVX-512: 16 at a time --------------------------------------------------
// GCC 12 warns inside its own AVX-512 intrinsics (their deliberately undefined
// pass-through operand) when -march lacks AVX-512: a false positive.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define ASHL_AVX512 __attribute__((target("avx512f,avx512bw")))

ASHL_AVX512 void widen_f16_avx512(float* dst, const uint16_t* src, int64_t m) {
  int64_t j = 0;
  for (; j + 16 <= m; j += 16)
    _mm512_storeu_ps(dst + j, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j))));
  widen_f16_portable(dst + j, src + j, m - j);
}
// 16 halves (32 bytes) to dst + j: streamed (dst + j 32-byte aligned) or not.
ASHL_AVX512 inline void put16(uint16_t* dst, int64_t j, __m256i v, bool stream) {
  if (stream) _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + j), v);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), v);
}
ASHL_AVX512 void narrow_f16_avx512(uint16_t* dst, const float* src, int64_t m, bool stream) {
  int64_t j = vector_start(dst, m, 32, stream);
  narrow_f16_portable(dst, src, j);
  for (; j + 16 <= m; j += 16)
    put16(dst, j, _mm512_cvtps_ph(_mm512_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT), stream);
  narrow_f16_portable(dst + j, src + j, m - j);
}
ASHL_AVX512 void widen_bf16_avx512(float* dst, const uint16_t* src, int64_t m) {
  int64_t j = 0;
  for (; j + 16 <= m; j += 16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j)));
    _mm512_storeu_ps(dst + j, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
  widen_bf16_portable(dst + j, src + j, m - j);
}
ASHL_AVX512 void narrow_bf16_avx512(uint16_t* dst, const float* src, int64_t m, bool stream) {
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i quiet = _mm512_set1_epi32(0x40);
  int64_t j = vector_start(dst, m, 32, stream);
  narrow_bf16_portable(dst, src, j);
  for (; j + 16 <= m; j += 16) {
    const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src + j));
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), _mm512_and_si512(hi, one)), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
    const __m512i r = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(hi, quiet));
    put16(dst, j, _mm512_cvtepi32_epi16(r), stream);
  }
  narrow_bf16_portable(dst + j, src + j, m - j);
}

#pragma GCC diagnostic pop

constexpr HalfConverters kAVX512{widen_f16_avx512, narrow_f16_avx512, widen_bf16_avx512,
                                 narrow_bf16_avx512, "avx512"};

bool cpu_has(const HalfConverters* c) {
  __builtin_cpu_init();
  if (c == &kAVX512) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (c == &kF16C) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return true;
}

// Best first.
constexpr const HalfConverters* kAll[] = {&kAVX512, &kF16C, &kPortable};
#else
bool cpu_has(const HalfConverters*) { return true; }
constexpr const HalfConverters* kAll[] = {&kPortable};
#endif

const HalfConverters* best() {
  for (const HalfConverters* c : kAll)
    if (cpu_has(c)) return c;
  return &kPortable;
}

std::atomic<const HalfConverters*> g_current{nullptr};

}  // namespace

const HalfConverters& halves() {
  const HalfConverters* c = g_current.load(std::memory_order_acquire);
  if (!c) {
    c = best();
    g_current.store(c, std::memory_order_release);
  }
  return *c;
}

void set_isa(const std::string& name) {
  if (name == "auto") {
    g_current.store(best(), std::memory_order_release);
    return;
  }
  for (const HalfConverters* c : kAll) {
    if (name != c->isa) continue;
    if (!cpu_has(c))
      throw std::invalid_argument("this CPU cannot run the '" + name + "' kernels (it supports: " +
                                  supported_isas() + ")");
    g_current.store(c, std::memory_order_release);
    return;
  }
  throw std::invalid_argument("unknown kernel ISA '" + name + "' (expected auto or one of: " +
                              supported_isas() + ")");
}

std::string isa() { return halves().isa; }

std::string supported_isas() {
  std::string out;
  for (const HalfConverters* c : kAll)
    if (cpu_has(c)) out += (out.empty() ? "" : ", ") + std::string(c->isa);
  return out;
}

}  // namespace ashl::cpu
