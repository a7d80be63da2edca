// The instruction-set layer of the integer CPU kernels (cpu_qlinear.cpp: int8 / int4 weights;
// cpu_klinear.cpp: GGUF's block types), included by both: activation rows quantized to int8 in
// blocks of 32, and per instruction set (AVX-512 VNNI, AVX2, a portable loop, chosen by the
// build's -march) the 16-lane vector types and the operations their tiles use. Every operation
// on I32 is exact; every F32 operation is one rounding (fma: one rounding of a * b + c), so a
// kernel written with them gives the same bits on every instruction set.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_rows.h"

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = 32;   // inputs per weight group and per activation block
constexpr int kMaxRows = 8;      // rows of x held in registers at once
// How far ahead of its loads a tile asks for weight lines (into the next blocks, which the same
// thread takes next): the hardware prefetcher alone falls behind when a tile of several rows
// spends longer on each line, and at one row 4 KiB ahead was too close: one thread over
// SmolLM2-135M's int4 layers read 29 GB/s with 4 KiB and 33 with 8 KiB, its int8 lm_head 49 and
// 56 GB/s (2026-12-06, docs/cpu-decode.md).
constexpr int64_t kPrefetchBytes = 8192;

// Each row of x, quantized once per call: codes [M, K], and per block (m, g) its scale d, the
// sum of its codes Q, and d * float(Q) (what an int4 shift multiplies); per half block (m, h), of
// 16 codes, their sum (what a block type's offset multiplies under sub-block scales).
struct Activations {
  int64_t K, groups;
  std::vector<int8_t> q;
  std::vector<float> d, dsum;
  std::vector<int32_t> sum, sum16;

  const int8_t* codes(int64_t m, int64_t g) const { return q.data() + m * K + g * kBlock; }
  int64_t at(int64_t m, int64_t g) const { return m * groups + g; }
};

Activations quantize_rows(const float* x, int64_t M, int64_t K) {
  Activations a{K, K / kBlock, std::vector<int8_t>(M * K), std::vector<float>(M * (K / kBlock)),
                std::vector<float>(M * (K / kBlock)), std::vector<int32_t>(M * (K / kBlock)),
                std::vector<int32_t>(2 * M * (K / kBlock))};
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < a.groups; ++g) {
        const float* xb = x + m * K + g * kBlock;
        float amax = 0.f;
        for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
        const float d = amax / 127.f;
        int8_t* qb = a.q.data() + m * K + g * kBlock;
        int32_t sum = 0;
        for (int64_t k = 0; k < kBlock; ++k) {
          const float r = d > 0.f ? std::nearbyint(xb[k] / d) : 0.f;
          qb[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
          sum += qb[k];
          if (k == kBlock / 2 - 1) a.sum16[2 * a.at(m, g)] = sum;
        }
        a.sum16[2 * a.at(m, g) + 1] = sum - a.sum16[2 * a.at(m, g)];
        a.d[a.at(m, g)] = d;
        a.sum[a.at(m, g)] = sum;
        a.dsum[a.at(m, g)] = d * static_cast<float>(sum);
      }
  });
  return a;
}

inline int32_t word(const int8_t* p) {  // 4 activation codes as one 32-bit word
  int32_t w;
  std::memcpy(&w, p, 4);
  return w;
}


// Per instruction set: I32 (16 int32 sums), F32 (16 floats), W (64 bytes of weights: 16 lanes x
// 4 codes) and the operations the tiles use. kInt8Bias: what each int8 sum S carries in excess, in
// units of Q (VNNI multiplies unsigned bytes by signed ones, so it reads int8 weights as
// code + 128 and its sums hold 128 * Q more; AVX2 and the loop undo the +128 in the weights).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
constexpr const char* kIsa = "avx512_vnni";
constexpr int32_t kInt8Bias = 128;
struct I32 { __m512i v; };
struct F32 { __m512 v; };
struct W { __m512i v; };
inline I32 izero() { return {_mm512_setzero_si512()}; }
inline I32 operator+(I32 a, I32 b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline F32 fzero() { return {_mm512_setzero_ps()}; }
inline F32 bcast(float s) { return {_mm512_set1_ps(s)}; }
inline F32 operator+(F32 a, F32 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F32 operator*(F32 a, F32 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F32 to_float(I32 a, int32_t minus) {
  return {_mm512_cvtepi32_ps(_mm512_sub_epi32(a.v, _mm512_set1_epi32(minus)))};
}
inline F32 load_half(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline F32 load_lanes(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* out, F32 v, int64_t width) {
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << width) - 1), v.v);
}
inline W load_int8(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline void load_int4(const uint8_t* p, W& lo, W& hi) {
  const __m512i v = _mm512_loadu_si512(p), nibble = _mm512_set1_epi8(15);
  lo = {_mm512_and_si512(v, nibble)};
  hi = {_mm512_and_si512(_mm512_srli_epi16(v, 4), nibble)};
}
inline I32 dot(I32 acc, W w, const int8_t* x) {  // acc += w (unsigned) . x (signed), 4 at a time
  return {_mm512_dpbusd_epi32(acc.v, w.v, _mm512_set1_epi32(word(x)))};
}
inline I32 dot_int8(I32 acc, W w, const int8_t* x) { return dot(acc, w, x); }
// For the block types: integer lanes, raw weight bytes, high code bits, one code per lane.
inline I32 ibcast(int32_t v) { return {_mm512_set1_epi32(v)}; }
inline I32 operator-(I32 a, I32 b) { return {_mm512_sub_epi32(a.v, b.v)}; }
inline I32 operator*(I32 a, I32 b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
inline I32 load_sub(const int8_t* p) {  // 16 int8 lanes
  return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline F32 load_u8(const uint8_t* p) {  // 16 uint8 lanes
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline F32 fma(F32 a, F32 b, F32 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline W load_raw(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline W operator|(W a, W b) { return {_mm512_or_si512(a.v, b.v)}; }
// Each byte's bits [shift, shift + bits) moved to bits [4, 4 + bits) (shift + bits <= 8)
inline W high_part(W h, int shift, int bits) {
  const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << bits) - 1));
  return {_mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h.v, shift), mask), 4)};
}
inline I32 column(W w, int i) {  // byte i of each lane's word
  return {_mm512_and_si512(_mm512_srli_epi32(w.v, 8 * i), _mm512_set1_epi32(255))};
}
inline void store_lanes(float* p, F32 v) { _mm512_storeu_ps(p, v.v); }
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
constexpr const char* kIsa = "avx2";
constexpr int32_t kInt8Bias = 0;
struct I32 { __m256i lo, hi; };
struct F32 { __m256 lo, hi; };
struct W { __m256i lo, hi; };
inline I32 izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I32 operator+(I32 a, I32 b) {
  return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
}
inline F32 fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F32 bcast(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
inline F32 operator+(F32 a, F32 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F32 operator*(F32 a, F32 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F32 to_float(I32 a, int32_t minus) {
  const __m256i m = _mm256_set1_epi32(minus);
  return {_mm256_cvtepi32_ps(_mm256_sub_epi32(a.lo, m)), _mm256_cvtepi32_ps(_mm256_sub_epi32(a.hi, m))};
}
inline F32 load_half(const uint16_t* p) {
  const auto* h = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(h)), _mm256_cvtph_ps(_mm_loadu_si128(h + 1))};
}
inline F32 load_lanes(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* out, F32 v, int64_t width) {
  float lanes[kLanes];
  _mm256_storeu_ps(lanes, v.lo);
  _mm256_storeu_ps(lanes + 8, v.hi);
  std::copy(lanes, lanes + width, out);
}
inline W load_bytes(const uint8_t* p) {
  const auto* v = reinterpret_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(v), _mm256_loadu_si256(v + 1)};
}
// int8 weights as signed codes (the +128 undone): maddubs multiplies unsigned by signed bytes,
// so |w| times x with w's sign (no int16 overflow: 2 * 127 * 127 < 2^15).
inline W load_int8(const uint8_t* p) {
  const W b = load_bytes(p);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  return {_mm256_xor_si256(b.lo, flip), _mm256_xor_si256(b.hi, flip)};
}
inline void load_int4(const uint8_t* p, W& lo, W& hi) {
  const W b = load_bytes(p);
  const __m256i nibble = _mm256_set1_epi8(15);
  lo = {_mm256_and_si256(b.lo, nibble), _mm256_and_si256(b.hi, nibble)};
  hi = {_mm256_and_si256(_mm256_srli_epi16(b.lo, 4), nibble),
        _mm256_and_si256(_mm256_srli_epi16(b.hi, 4), nibble)};
}
// acc += w . x over each 4 bytes: maddubs sums pairs of unsigned w times signed x into int16
// (callers keep each pair below 2^15), madd sums pairs of those into int32.
inline __m256i dot8(__m256i acc, __m256i w_unsigned, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(w_unsigned, x);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
inline I32 dot(I32 acc, W w, const int8_t* x) {  // w in [0, 15]: 2 * 15 * 127 < 2^15
  const __m256i xv = _mm256_set1_epi32(word(x));
  return {dot8(acc.lo, w.lo, xv), dot8(acc.hi, w.hi, xv)};
}
inline I32 dot_int8(I32 acc, W w, const int8_t* x) {
  const __m256i xv = _mm256_set1_epi32(word(x));
  return {dot8(acc.lo, _mm256_sign_epi8(w.lo, w.lo), _mm256_sign_epi8(xv, w.lo)),
          dot8(acc.hi, _mm256_sign_epi8(w.hi, w.hi), _mm256_sign_epi8(xv, w.hi))};
}
// For the block types: integer lanes, raw weight bytes, high code bits, one code per lane.
inline I32 ibcast(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline I32 operator-(I32 a, I32 b) {
  return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)};
}
inline I32 operator*(I32 a, I32 b) {
  return {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)};
}
inline I32 load_sub(const int8_t* p) {
  const auto* v = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtepi8_epi32(_mm_loadl_epi64(v)),
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline F32 load_u8(const uint8_t* p) {
  const auto lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const auto hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8));
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi))};
}
inline F32 fma(F32 a, F32 b, F32 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline W load_raw(const uint8_t* p) { return load_bytes(p); }
inline W operator|(W a, W b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
inline W high_part(W h, int shift, int bits) {
  const __m256i mask = _mm256_set1_epi8(static_cast<char>((1 << bits) - 1));
  return {_mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h.lo, shift), mask), 4),
          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h.hi, shift), mask), 4)};
}
inline I32 column(W w, int i) {
  const __m256i byte = _mm256_set1_epi32(255);
  return {_mm256_and_si256(_mm256_srli_epi32(w.lo, 8 * i), byte),
          _mm256_and_si256(_mm256_srli_epi32(w.hi, 8 * i), byte)};
}
inline void store_lanes(float* p, F32 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
#else
constexpr const char* kIsa = "portable";
constexpr int32_t kInt8Bias = 0;
struct I32 { int32_t v[kLanes]; };
struct F32 { float v[kLanes]; };
struct W { int32_t v[kLanes][4]; };  // signed codes
inline I32 izero() { return {}; }
inline I32 operator+(I32 a, I32 b) { for (int l = 0; l < kLanes; ++l) a.v[l] += b.v[l]; return a; }
inline F32 fzero() { return {}; }
inline F32 bcast(float s) { F32 r; std::fill(r.v, r.v + kLanes, s); return r; }
inline F32 operator+(F32 a, F32 b) { for (int l = 0; l < kLanes; ++l) a.v[l] += b.v[l]; return a; }
inline F32 operator*(F32 a, F32 b) { for (int l = 0; l < kLanes; ++l) a.v[l] *= b.v[l]; return a; }
inline F32 to_float(I32 a, int32_t minus) {
  F32 r;
  for (int l = 0; l < kLanes; ++l) r.v[l] = static_cast<float>(a.v[l] - minus);
  return r;
}
inline F32 load_half(const uint16_t* p) {
  F32 r;
  for (int l = 0; l < kLanes; ++l) r.v[l] = static_cast<float>(c10::Half(p[l], c10::Half::from_bits()));
  return r;
}
inline F32 load_lanes(const float* p) { F32 r; std::copy(p, p + kLanes, r.v); return r; }
inline void store(float* out, F32 v, int64_t width) { std::copy(v.v, v.v + width, out); }
inline W load_int8(const uint8_t* p) {
  W w;
  for (int l = 0; l < kLanes; ++l)
    for (int i = 0; i < 4; ++i) w.v[l][i] = static_cast<int32_t>(p[4 * l + i]) - 128;
  return w;
}
inline void load_int4(const uint8_t* p, W& lo, W& hi) {
  for (int l = 0; l < kLanes; ++l)
    for (int i = 0; i < 4; ++i) {
      lo.v[l][i] = p[4 * l + i] & 15;
      hi.v[l][i] = p[4 * l + i] >> 4;
    }
}
inline I32 dot(I32 acc, const W& w, const int8_t* x) {
  for (int l = 0; l < kLanes; ++l)
    for (int i = 0; i < 4; ++i) acc.v[l] += w.v[l][i] * x[i];
  return acc;
}
inline I32 dot_int8(I32 acc, const W& w, const int8_t* x) { return dot(acc, w, x); }
// For the block types: integer lanes, raw weight bytes, high code bits, one code per lane.
inline I32 ibcast(int32_t v) { I32 r; std::fill(r.v, r.v + kLanes, v); return r; }
inline I32 operator-(I32 a, I32 b) { for (int l = 0; l < kLanes; ++l) a.v[l] -= b.v[l]; return a; }
inline I32 operator*(I32 a, I32 b) { for (int l = 0; l < kLanes; ++l) a.v[l] *= b.v[l]; return a; }
inline I32 load_sub(const int8_t* p) { I32 r; std::copy(p, p + kLanes, r.v); return r; }
inline F32 load_u8(const uint8_t* p) { F32 r; std::copy(p, p + kLanes, r.v); return r; }
inline F32 fma(F32 a, F32 b, F32 c) {
  for (int l = 0; l < kLanes; ++l) c.v[l] = std::fma(a.v[l], b.v[l], c.v[l]);
  return c;
}
inline W load_raw(const uint8_t* p) {
  W w;
  for (int l = 0; l < kLanes; ++l)
    for (int i = 0; i < 4; ++i) w.v[l][i] = p[4 * l + i];
  return w;
}
inline W operator|(W a, const W& b) {
  for (int l = 0; l < kLanes; ++l)
    for (int i = 0; i < 4; ++i) a.v[l][i] |= b.v[l][i];
  return a;
}
inline W high_part(W h, int shift, int bits) {
  for (int l = 0; l < kLanes; ++l)
    for (int i = 0; i < 4; ++i) h.v[l][i] = ((h.v[l][i] >> shift) & ((1 << bits) - 1)) << 4;
  return h;
}
inline I32 column(const W& w, int i) { I32 r; for (int l = 0; l < kLanes; ++l) r.v[l] = w.v[l][i]; return r; }
inline void store_lanes(float* p, F32 v) { std::copy(v.v, v.v + kLanes, p); }
#endif

struct Problem {
  int64_t M, K, N, nb;
  float* out;
  const float* bias;  // [N] or null

  int64_t width(int64_t b) const { return std::min(kLanes, N - b * kLanes); }
  F32 bias_of(int64_t b) const {
    float v[kLanes] = {};
    if (bias != nullptr) std::copy(bias + b * kLanes, bias + b * kLanes + width(b), v);
    return load_lanes(v);
  }
};

// Every block of W, split among torch's threads; ``block(b, m0, MT)`` computes rows
// [m0, m0 + MT) of block b. A block (at most K * 16 bytes) stays in cache while the row tiles
// take their turns.
template <class Block>
void for_each_block(const Problem& p, int64_t bytes_per_block, Block block) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / bytes_per_block);
  at::parallel_for(0, p.nb, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t m0 = 0; m0 < p.M; m0 += kMaxRows)
        with_rows<kMaxRows>(static_cast<int>(std::min<int64_t>(kMaxRows, p.M - m0)),
                  [&](auto MT) { block(b, m0, MT); });
  });
}

const uint16_t* halves(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
}

}  // namespace
