// Block conversions between fp32 and the 16-bit storage types (fp16, bf16),
// vectorised for the instruction sets this CPU has, chosen at run time.
//
// The CPU kernels run their ops on fp32 blocks; a 16-bit operand is widened
// into a block before the op and an fp32 result narrowed out of one after it.
// Every path rounds to nearest even (NaN stays a quiet NaN), so all give the
// same bits: the portable one is the reference and stays tested (ISA "portable").
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace ashl::cpu {

// A narrowing with `stream` writes dst with non-temporal stores from the
// registers that hold the converted values (after a scalar head up to the store
// width's alignment): for a destination too large to stay cached, one write
// instead of a read-for-ownership plus a write. The caller fences.
struct HalfConverters {
  void (*widen_f16)(float* dst, const uint16_t* src, int64_t m);
  void (*narrow_f16)(uint16_t* dst, const float* src, int64_t m, bool stream);
  void (*widen_bf16)(float* dst, const uint16_t* src, int64_t m);
  void (*narrow_bf16)(uint16_t* dst, const float* src, int64_t m, bool stream);
  const char* isa;
};

// The converters in use: the best this CPU supports, unless set_isa chose.
const HalfConverters& halves();

// "auto" (the best supported), "avx512", "f16c" or "portable". Throws
// std::invalid_argument for an unknown name or one this CPU lacks.
void set_isa(const std::string& name);
std::string isa();
// The ISAs this CPU can run, best first ("portable" always last).
std::string supported_isas();

// ---- scalar conversions: the portable path, the tails, the sparse scatter --
// Bit-exact with the hardware paths, NaN payloads included (quietened, the
// payload's top bits kept, as vcvtps2ph/vcvtph2ps do).

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0u));
  if (exp == 0) {
    if (man == 0) return bits_f32(sign);
    exp = 127 - 15 + 1;  // a subnormal half: renormalise
    while (!(man & 0x400u)) { man <<= 1; --exp; }
    man &= 0x3ffu;
    return bits_f32(sign | (exp << 23) | (man << 13));
  }
  return bits_f32(sign | ((exp + 127 - 15) << 23) | (man << 13));
}

inline uint16_t float_to_half_bits(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u | uint16_t((a >> 13) & 0x3ffu);
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: Inf
  if (a < 0x38800000u) {                         // subnormal or zero in half
    const float scaled = bits_f32(a) * 16777216.0f;  // * 2^24: exact
    return sign | uint16_t(static_cast<uint32_t>(__builtin_rintf(scaled)));
  }
  const uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - ((127u - 15u) << 23);
  return sign | uint16_t(r >> 13);
}

inline float bf16_bits_to_float(uint16_t b) { return bits_f32(uint32_t(b) << 16); }

// Round to nearest even, as torch does; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t rounded = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  const uint16_t quiet_nan = uint16_t((u >> 16) | 0x40u);
  return ((u & 0x7fffffffu) > 0x7f800000u) ? quiet_nan : rounded;
}

}  // namespace ashl::cpu
