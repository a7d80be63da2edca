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
// int4 weights come with stored shifts (the asymmetric scheme, GGUF's Q4_1: 20 bytes a group) or
// without (the scale-only scheme, Q4_0: 18 bytes a group), where shift = scale * -8 is computed
// in registers: exact (a power of two times a float16), so the result is bit for bit that of the
// same kernel given shifts = -8 * scales.
//
// S and Q are exact in int32 (|S| <= 32 * 127 * 255), and so is float(S) (< 2^24).
// Weights, in blocks of 16 output rows ("lanes") whose 4-byte words each hold one lane's codes of
// 4 (int8) or 8 (int4) consecutive inputs, the operand shape of the integer dot-product
// instructions:
//
//     int8  [NB, K/4, 16, 4] u8   word (j, lane): code + 128 of k = 4j .. 4j + 3
//     int4  [NB, K/8, 16, 4] u8   byte i of word (j, lane): low nibble k = 8j + i, high 8j + 4 + i
//     scale, shift [NB, K/32, 16] float16 (shift: int4 with stored shifts only)
//
// Invariant (exactness): the integer sums are exact whatever instructions compute them (AVX-512
// VNNI, AVX2, the portable loop), and every float operation above is one rounding in the order
// written (the build has -ffp-contract=off; no fused multiply-add here): groups ascending into
// one accumulator, then the bias. So an output equals, bit for bit, a torch reference doing the
// same arithmetic, and a row's result is the same alone or in any batch, in any position, and
// whatever the thread split. The activation quantization and the instruction-set layer live in
// cpu_qisa.h, shared with cpu_klinear.cpp.
#include "cpu_qisa.h"

#include <string>

namespace {

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

// The int4 kernel, with shifts read from ``hp`` (kShifts) or computed as scale * -8.
template <bool kShifts>
void w4a8(const Problem& p, const Activations& a, const uint8_t* wp, const uint16_t* sp,
          const uint16_t* hp) {
  const int64_t groups = a.groups, block_bytes = p.K / 2 * kLanes, n = p.N;
  for_each_block(p, block_bytes, [&](int64_t b, int64_t m0, auto MT) {
    constexpr int kRows = decltype(MT)::value;
    const uint8_t* wb = wp + b * block_bytes;
    const uint16_t* sb = sp + b * groups * kLanes;
    const uint16_t* hb = kShifts ? hp + b * groups * kLanes : nullptr;
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
      const F32 scale = load_half(sb + g * kLanes);
      F32 shift;
      if constexpr (kShifts)
        shift = load_half(hb + g * kLanes);
      else
        shift = scale * bcast(-8.f);
#pragma GCC unroll 8
      for (int i = 0; i < kRows; ++i) {
        const int64_t at = a.at(m0 + i, g);
        acc[i] = acc[i] + to_float(s[i], 0) * (scale * bcast(a.d[at]));
        acc[i] = acc[i] + shift * bcast(a.dsum[at]);
      }
    };
    tile<kRows>(groups, sums, fold, p.bias_of(b), p.out + m0 * n + b * kLanes, n, p.width(b));
  });
}

at::Tensor linear_w4a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& shifts,
                       const c10::optional<at::Tensor>& bias, int64_t n) {
  check_common(x, w, x.size(1) / 8, scales, bias, n);
  if (shifts.has_value()) check_common(x, w, x.size(1) / 8, *shifts, bias, n);
  auto out = at::empty({x.size(0), n}, x.options());
  const Problem p = problem(x, out, w, bias, n);
  const Activations a = quantize_rows(x.data_ptr<float>(), p.M, p.K);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (shifts.has_value())
    w4a8<true>(p, a, wp, halves(scales), halves(*shifts));
  else
    w4a8<false>(p, a, wp, halves(scales), nullptr);
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
      "linear_w4a8(Tensor x, Tensor w, Tensor scales, Tensor? shifts, Tensor? bias, int n) -> "
      "Tensor");
  m.def("qlinear_isa() -> str", &qlinear_isa);
}

TORCH_LIBRARY_IMPL(QLINEAR_NAMESPACE, CPU, m) {
  m.impl("linear_w8a8", &linear_w8a8);
  m.impl("linear_w4a8", &linear_w4a8);
}
