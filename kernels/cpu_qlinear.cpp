// CPU linear kernels on quantized activations (W8A8, W4A8): y[M, N] = x[M, K] W^T (+ bias) for
// int8 and int4 weights in groups of 32 inputs, with every row of x quantized to int8 in blocks of
// 32 (one float32 scale each) and each block's dot product summed in integers:
//
//     x block (m, g):  d = max|x| / 127,  q = round_half_even(x / d) in [-127, 127]  (d = 0: q = 0)
//     per output (m, n), from acc = 0, for each group g of 32 inputs ascending:
//       int8 weights:  acc += float(S) * (scale[n, g] * d)
//       int4 weights:  acc += float(S) * (scale[n, g] * d);  acc += shift[n, g] * (d * float(Q))
//     y[m, n] = acc + bias[n]
//     with S = sum_k code[n, k] q[m, k] and Q = sum_k q[m, k] over the group's 32 inputs
//
// S and Q are exact in int32 (|S| <= 32 * 127 * 255), and so is float(S) (< 2^24).
// Weights, in blocks of 16 output rows ("lanes") whose 4-byte words each hold one lane's codes of
// 4 (int8) or 8 (int4) consecutive inputs, the operand shape of the integer dot-product
// instructions:
//
//     int8  [NB, K/4, 16, 4] u8   word (j, lane): code + 128 of k = 4j .. 4j + 3
//     int4  [NB, K/8, 16, 4] u8   byte i of word (j, lane): low nibble k = 8j + i, high 8j + 4 + i
//     scale, shift [NB, K/32, 16] float16
//
// Invariant (exactness): the integer sums are exact whatever instructions compute them (AVX-512
// VNNI, AVX2, the portable loop), and every float operation above is one rounding in the order
// written (the build has -ffp-contract=off; no fused multiply-add here): groups ascending into
// one accumulator, then the bias. So an output equals, bit for bit, a torch reference doing the
// same arithmetic, and a row's result is the same alone or in any batch, in any position, and
// whatever the thread split.
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

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = 32;   // inputs per weight group and per activation block
constexpr int kMaxRows = 8;      // rows of x held in registers at once
// How far ahead of its loads a tile asks for weight lines (into the next blocks, which the same
// thread takes next): the hardware prefetcher alone falls behind when a tile of several rows
// spends longer on each line.
constexpr int64_t kPrefetchBytes = 4096;

// Each row of x, quantized once per call: codes [M, K], and per block (m, g) its scale d, the
// sum of its codes Q, and d * float(Q) (what an int4 shift multiplies).
struct Activations {
  int64_t K, groups;
  std::vector<int8_t> q;
  std::vector<float> d, dsum;
  std::vector<int32_t> sum;

  const int8_t* codes(int64_t m, int64_t g) const { return q.data() + m * K + g * kBlock; }
  int64_t at(int64_t m, int64_t g) const { return m * groups + g; }
};

Activations quantize_rows(const float* x, int64_t M, int64_t K) {
  Activations a{K, K / kBlock, std::vector<int8_t>(M * K), std::vector<float>(M * (K / kBlock)),
                std::vector<float>(M * (K / kBlock)), std::vector<int32_t>(M * (K / kBlock))};
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
        }
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
#elif defined(__AVX2__) && defined(__F16C__)
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
#endif

// Independent integer sums per row within a group: a dot-product instruction waits for the one
// before it on the same accumulator, so a tile of few rows spreads each group over several
// accumulators and adds them (integer sums: the order does not matter).
template <int MT>
constexpr int kChains = MT >= 4 ? 1 : MT >= 2 ? 2 : 4;

// One tile: rows [m0, m0 + MT) of x times one block of W (16 lanes). Per group g, ascending:
// ``sums(g, s)`` adds the group's integer sums of row i to s[c * MT + i] for some c <
// kChains<MT>, ``fold(g, s, acc)`` scales each row's total into its float accumulator; then each
// row's result plus the bias is stored.
template <int MT, class Sums, class Fold>
inline void tile(int64_t groups, Sums sums, Fold fold, F32 bias, float* out, int64_t ldo,
                 int64_t width) {
  F32 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = fzero();
  for (int64_t g = 0; g < groups; ++g) {
    I32 s[kChains<MT> * MT];
    for (int i = 0; i < kChains<MT> * MT; ++i) s[i] = izero();
    sums(g, s);
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i)
      for (int c = 1; c < kChains<MT>; ++c) s[i] = s[i] + s[c * MT + i];
    fold(g, s, acc);
  }
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) store(out + i * ldo, acc[i] + bias, width);
}

template <class F>
inline void with_rows(int mt, F f) {
  switch (mt) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

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
        with_rows(static_cast<int>(std::min<int64_t>(kMaxRows, p.M - m0)),
                  [&](auto MT) { block(b, m0, MT); });
  });
}

void check_common(const at::Tensor& x, const at::Tensor& w, int64_t words, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, "K must be a multiple of 32");
  TORCH_CHECK(w.dim() == 4 && w.size(0) * kLanes >= n && w.size(0) * kLanes < n + kLanes &&
                  w.size(1) == words && w.size(2) == kLanes && w.size(3) == 4 &&
                  w.scalar_type() == at::kByte && w.is_contiguous(),
              "w must be packed uint8 [ceil(N/16), K/4 (int8) or K/8 (int4), 16, 4]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 3 &&
                  scales.size(0) == w.size(0) && scales.size(1) == K / kBlock &&
                  scales.size(2) == kLanes,
              "scales and shifts must be float16 [ceil(N/16), K/32, 16]");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "bias must be a contiguous float32 [N] tensor");
}

Problem problem(const at::Tensor& x, at::Tensor& out, const at::Tensor& w,
                const c10::optional<at::Tensor>& bias, int64_t n) {
  return {x.size(0), x.size(1), n, w.size(0), out.data_ptr<float>(),
          bias.has_value() ? bias->data_ptr<float>() : nullptr};
}

const uint16_t* halves(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
}

at::Tensor linear_w8a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias, int64_t n) {
  check_common(x, w, x.size(1) / 4, scales, bias, n);
  auto out = at::empty({x.size(0), n}, x.options());
  const Problem p = problem(x, out, w, bias, n);
  const Activations a = quantize_rows(x.data_ptr<float>(), p.M, p.K);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* sp = halves(scales);
  const int64_t groups = a.groups, block_bytes = p.K * kLanes;
  for_each_block(p, block_bytes, [&](int64_t b, int64_t m0, auto MT) {
    constexpr int kRows = decltype(MT)::value;
    const uint8_t* wb = wp + b * block_bytes;
    const uint16_t* sb = sp + b * groups * kLanes;
    auto sums = [&](int64_t g, I32* s) {
      const uint8_t* wg = wb + g * kBlock * kLanes;
#pragma GCC unroll 8
      for (int j = 0; j < kBlock / 4; ++j) {
        __builtin_prefetch(wg + j * 4 * kLanes + kPrefetchBytes);
        const W wv = load_int8(wg + j * 4 * kLanes);
#pragma GCC unroll 8
        for (int i = 0; i < kRows; ++i) {
          I32& sum = s[j % kChains<kRows> * kRows + i];
          sum = dot_int8(sum, wv, a.codes(m0 + i, g) + 4 * j);
        }
      }
    };
    auto fold = [&](int64_t g, const I32* s, F32* acc) {
      const F32 scale = load_half(sb + g * kLanes);
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) {
        const int64_t at = a.at(m0 + i, g);
        acc[i] = acc[i] + to_float(s[i], kInt8Bias * a.sum[at]) * (scale * bcast(a.d[at]));
      }
    };
    tile<kRows>(groups, sums, fold, p.bias_of(b), p.out + m0 * n + b * kLanes, n, p.width(b));
  });
  return out;
}

at::Tensor linear_w4a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const at::Tensor& shifts, const c10::optional<at::Tensor>& bias, int64_t n) {
  check_common(x, w, x.size(1) / 8, scales, bias, n);
  check_common(x, w, x.size(1) / 8, shifts, bias, n);
  auto out = at::empty({x.size(0), n}, x.options());
  const Problem p = problem(x, out, w, bias, n);
  const Activations a = quantize_rows(x.data_ptr<float>(), p.M, p.K);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t *sp = halves(scales), *hp = halves(shifts);
  const int64_t groups = a.groups, block_bytes = p.K / 2 * kLanes;
  for_each_block(p, block_bytes, [&](int64_t b, int64_t m0, auto MT) {
    constexpr int kRows = decltype(MT)::value;
    const uint8_t* wb = wp + b * block_bytes;
    const uint16_t* sb = sp + b * groups * kLanes;
    const uint16_t* hb = hp + b * groups * kLanes;
    auto sums = [&](int64_t g, I32* s) {
      const uint8_t* wg = wb + g * kBlock / 2 * kLanes;
#pragma GCC unroll 4
      for (int j = 0; j < kBlock / 8; ++j) {
        W lo, hi;
        __builtin_prefetch(wg + j * 4 * kLanes + kPrefetchBytes);
        load_int4(wg + j * 4 * kLanes, lo, hi);
#pragma GCC unroll 8
        for (int i = 0; i < kRows; ++i) {
          const int8_t* xg = a.codes(m0 + i, g) + 8 * j;
          constexpr int kC = kChains<kRows>;
          I32& sum_lo = s[(2 * j) % kC * kRows + i];
          sum_lo = dot(sum_lo, lo, xg);
          I32& sum_hi = s[(2 * j + 1) % kC * kRows + i];
          sum_hi = dot(sum_hi, hi, xg + 4);
        }
      }
    };
    auto fold = [&](int64_t g, const I32* s, F32* acc) {
      const F32 scale = load_half(sb + g * kLanes), shift = load_half(hb + g * kLanes);
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) {
        const int64_t at = a.at(m0 + i, g);
        acc[i] = acc[i] + to_float(s[i], 0) * (scale * bcast(a.d[at]));
        acc[i] = acc[i] + shift * bcast(a.dsum[at]);
      }
    };
    tile<kRows>(groups, sums, fold, p.bias_of(b), p.out + m0 * n + b * kLanes, n, p.width(b));
  });
  return out;
}

std::string qlinear_isa() { return kIsa; }

}  // namespace

// The ops' namespace: prefixserve_cpu, or another where a test builds this file alone for another
// instruction set (-march) and loads it beside the engine's build.
#ifndef QLINEAR_NAMESPACE
#define QLINEAR_NAMESPACE prefixserve_cpu
#endif

TORCH_LIBRARY_FRAGMENT(QLINEAR_NAMESPACE, m) {
  m.def("linear_w8a8(Tensor x, Tensor w, Tensor scales, Tensor? bias, int n) -> Tensor");
  m.def(
      "linear_w4a8(Tensor x, Tensor w, Tensor scales, Tensor shifts, Tensor? bias, int n) -> "
      "Tensor");
  m.def("qlinear_isa() -> str", &qlinear_isa);
}

TORCH_LIBRARY_IMPL(QLINEAR_NAMESPACE, CPU, m) {
  m.impl("linear_w8a8", &linear_w8a8);
  m.impl("linear_w4a8", &linear_w4a8);
}
