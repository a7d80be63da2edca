// CPU linear kernels for GGUF's block types kept as the file holds them (Q5_0, Q5_1, Q4_K, Q5_K,
// Q6_K: quantization.BlockWeight): y[M, N] = x[M, K] W^T (+ bias), on int8 activations
// (linear_kq8) or float32 activations (linear_kf32). Per output n and group g of 32 inputs,
//
//     w[n, k] = scale(g) * (sub(k) * (code[n, k] - offset)) + shift(g) * min(g)
//
// scale and shift: float16 per `span` groups; sub: int8 per 16 inputs (1 where absent); min: uint8
// per group (1 where absent); shift 0 where absent. Codes have 4 to 6 bits.
//
// int8 activations (x blocks quantized as cpu_qisa.h's quantize_rows: scale d, codes q, half-block
// code sums Q0, Q1, Q = Q0 + Q1), per output (m, n), from acc = 0, groups ascending:
//
//     T_h = sum over half h (16 inputs) of code * q                        (exact int32)
//     S   = sub_0 * (T_0 - offset * Q0) + sub_1 * (T_1 - offset * Q1)      with sub-scales
//     S   = (T_0 + T_1) - offset * Q                                       without
//     acc += float(S) * (scale * d);   with a shift: acc += (shift * float(min)) * (d * float(Q))
//     y = acc + bias
//
// |S| < 2^24 (|code - offset| <= 32, |sub| <= 128, |q| <= 127: 2 * 16 * 32 * 127 * 128 < 2^24),
// so float(S) is exact; shift * float(min) is exact (11 + 8 significant bits).
//
// float activations, per output (m, n), from acc = 0, groups ascending:
//
//     part = 0; for k in the group ascending: part = fma(v[k], x[m, k], part)
//                 with v[k] = float(sub(k) * (code - offset)), exact
//     acc = fma(part, scale, acc);   with a shift: acc = fma(shift * float(min), xsum, acc)
//     y = acc + bias                 xsum: the group's x summed in order, from 0
//
// Weights, in blocks of 16 output rows ("lanes"):
//
//     low    [NB, K/8, 16, 4] u8     code bits 0-3, as cpu_qlinear's int4: byte i of word
//                                    (j, lane): low nibble k = 8j + i, high nibble k = 8j + 4 + i
//     high   [NB, K/32, E, 16, 4] u8 E = bits - 4 (none for 4 bits): code bits 4 .. 3 + E of
//                                    the value in slot s = 2 * jj + half of group g (k = 32 g +
//                                    8 jj + 4 half + i) are bits (s E) % 8 .. of byte i of word
//                                    (g, s E / 8, lane)
//     scales, shifts [NB, K/32/span, 16] f16;  sub [NB, K/16, 16] i8;  mins [NB, K/32, 16] u8
//
// Invariant (exactness): integer sums are exact on every instruction set and every float
// operation is the one rounding written (-ffp-contract=off, fma written out), in the order
// written, so an output is the same bits alone or in any batch, in any thread split, on AVX-512
// VNNI, AVX2 and the portable loop, and the int8 path equals a torch reference of the same
// arithmetic bit for bit.
#include "cpu_qisa.h"

namespace {

struct Blocks {
  const uint8_t *low, *high;
  const uint16_t *scales, *shifts;
  const int8_t* sub;
  const uint8_t* mins;
  int64_t K, groups, span;
  int offset;

  int64_t low_bytes() const { return K / 2 * kLanes; }
  // group g's first byte in block b of each tensor
  const uint8_t* low_of(int64_t b, int64_t g) const { return low + b * low_bytes() + g * 16 * kLanes; }
  const uint16_t* scale_of(const uint16_t* t, int64_t b, int64_t g) const {
    return t + (b * (groups / span) + g / span) * kLanes;
  }
};

// Group g's codes at step j (inputs 8j .. 8j + 7 of the group): lo holds k = 8j + i, hi
// k = 8j + 4 + i, byte i of each lane's word.
template <int E>
inline void load_codes(const Blocks& w, int64_t b, int64_t g, int j, W& lo, W& hi) {
  load_int4(w.low_of(b, g) + j * 4 * kLanes, lo, hi);
  if constexpr (E > 0) {
    const uint8_t* h = w.high + (b * w.groups + g) * E * 4 * kLanes;
    const int s0 = 2 * j * E, s1 = (2 * j + 1) * E;
    lo = lo | high_part(load_raw(h + s0 / 8 * 4 * kLanes), s0 % 8, E);
    hi = hi | high_part(load_raw(h + s1 / 8 * 4 * kLanes), s1 % 8, E);
  }
}

// shift(g) * float(min(g)) per lane (min 1 where absent)
inline F32 shift_of(const Blocks& w, int64_t b, int64_t g) {
  const F32 shift = load_half(w.scale_of(w.shifts, b, g));
  if (w.mins == nullptr) return shift;
  return shift * load_u8(w.mins + (b * w.groups + g) * kLanes);
}

inline I32 sub_of(const Blocks& w, int64_t b, int64_t g, int h) {
  return load_sub(w.sub + (b * 2 * w.groups + 2 * g + h) * kLanes);
}

// int8 activations: rows [m0, m0 + MT) of x times block b. H = 2 keeps the halves' sums apart
// (sub-block scales), H = 1 sums the group at once.
template <int E, int H, int MT>
void block_q8(const Blocks& w, const Activations& a, const Problem& p, int64_t b, int64_t m0) {
  F32 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = fzero();
  for (int64_t g = 0; g < w.groups; ++g) {
    I32 t[H][MT];
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < MT; ++i) t[h][i] = izero();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __builtin_prefetch(w.low_of(b, g) + j * 4 * kLanes + kPrefetchBytes);
      W lo, hi;
      load_codes<E>(w, b, g, j, lo, hi);
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) {
        const int8_t* xg = a.codes(m0 + i, g) + 8 * j;
        I32& s = t[H == 2 ? j / 2 : 0][i];
        s = dot(dot(s, lo, xg), hi, xg + 4);
      }
    }
    const F32 scale = load_half(w.scale_of(w.scales, b, g));
    const F32 shift = w.shifts != nullptr ? shift_of(w, b, g) : fzero();
    I32 sub[H];
    if constexpr (H == 2) sub[0] = sub_of(w, b, g, 0), sub[1] = sub_of(w, b, g, 1);
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const int64_t at = a.at(m0 + i, g);
      I32 s;
      if constexpr (H == 2)
        s = sub[0] * (t[0][i] - ibcast(w.offset * a.sum16[2 * at])) +
            sub[1] * (t[1][i] - ibcast(w.offset * a.sum16[2 * at + 1]));
      else
        s = t[0][i] - ibcast(w.offset * a.sum[at]);
      acc[i] = acc[i] + to_float(s, 0) * (scale * bcast(a.d[at]));
      if (w.shifts != nullptr) acc[i] = acc[i] + shift * bcast(a.dsum[at]);
    }
  }
  const F32 bias = p.bias_of(b);
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) store(p.out + (m0 + i) * p.N + b * kLanes, acc[i] + bias, p.width(b));
}

// float activations: block b's values v = float(sub * (code - offset)) into scratch [K, 16]
template <int E>
void unpack(const Blocks& w, int64_t b, float* scratch) {
  const I32 offset = ibcast(w.offset);
  for (int64_t g = 0; g < w.groups; ++g)
    for (int j = 0; j < 4; ++j) {
      W lo, hi;
      load_codes<E>(w, b, g, j, lo, hi);
      const I32 sub = w.sub != nullptr ? sub_of(w, b, g, j / 2) : ibcast(1);
      float* out = scratch + (g * kBlock + 8 * j) * kLanes;
      for (int i = 0; i < 4; ++i) {
        store_lanes(out + i * kLanes, to_float(sub * (column(lo, i) - offset), 0));
        store_lanes(out + (4 + i) * kLanes, to_float(sub * (column(hi, i) - offset), 0));
      }
    }
}

template <int MT>
void block_f32(const Blocks& w, const float* v, const float* x, const float* xsum,
               const Problem& p, int64_t b, int64_t m0) {
  F32 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = fzero();
  for (int64_t g = 0; g < w.groups; ++g) {
    F32 part[MT];
    for (int i = 0; i < MT; ++i) part[i] = fzero();
    for (int64_t k = g * kBlock; k < (g + 1) * kBlock; ++k) {
      const F32 vk = load_lanes(v + k * kLanes);
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) part[i] = fma(vk, bcast(x[(m0 + i) * p.K + k]), part[i]);
    }
    const F32 scale = load_half(w.scale_of(w.scales, b, g));
    const F32 shift = w.shifts != nullptr ? shift_of(w, b, g) : fzero();
#pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      acc[i] = fma(part[i], scale, acc[i]);
      if (w.shifts != nullptr) acc[i] = fma(shift, bcast(xsum[(m0 + i) * w.groups + g]), acc[i]);
    }
  }
  const F32 bias = p.bias_of(b);
#pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) store(p.out + (m0 + i) * p.N + b * kLanes, acc[i] + bias, p.width(b));
}

// Calls f(std::integral_constant<int, E>{}) for E = bits - 4.
template <class F>
void with_high_bits(int64_t bits, F f) {
  switch (bits) {
    case 4: return f(std::integral_constant<int, 0>{});
    case 5: return f(std::integral_constant<int, 1>{});
    default: return f(std::integral_constant<int, 2>{});
  }
}

template <class T>
const T* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

void check_params(const c10::optional<at::Tensor>& t, at::ScalarType type, int64_t nb,
                  int64_t rows, const char* what) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->scalar_type() == type && t->is_contiguous() && t->dim() == 3 &&
                  t->size(0) == nb && t->size(1) == rows && t->size(2) == kLanes,
              what);
}

Blocks blocks(const at::Tensor& x, const at::Tensor& low, const c10::optional<at::Tensor>& high,
              const at::Tensor& scales, const c10::optional<at::Tensor>& sub,
              const c10::optional<at::Tensor>& shifts, const c10::optional<at::Tensor>& mins,
              int64_t bits, int64_t offset, int64_t span, const c10::optional<at::Tensor>& bias,
              int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const int64_t K = x.size(1), nb = low.size(0);
  TORCH_CHECK(bits >= 4 && bits <= 6 && offset >= 0 && offset <= 32 && span >= 1,
              "bits must be 4 to 6, offset 0 to 32, span positive");
  TORCH_CHECK(K % (kBlock * span) == 0, "K must be a multiple of 32 * span");
  TORCH_CHECK(low.dim() == 4 && nb * kLanes >= n && nb * kLanes < n + kLanes &&
                  low.size(1) == K / 8 && low.size(2) == kLanes && low.size(3) == 4 &&
                  low.scalar_type() == at::kByte && low.is_contiguous(),
              "low must be packed uint8 [ceil(N/16), K/8, 16, 4]");
  const int64_t E = bits - 4, groups = K / kBlock;
  TORCH_CHECK(high.has_value() == (E > 0), "high bits are given exactly for codes past 4 bits");
  if (E > 0)
    TORCH_CHECK(high->dim() == 5 && high->size(0) == nb && high->size(1) == groups &&
                    high->size(2) == E && high->size(3) == kLanes && high->size(4) == 4 &&
                    high->scalar_type() == at::kByte && high->is_contiguous(),
                "high must be packed uint8 [ceil(N/16), K/32, bits - 4, 16, 4]");
  check_params(scales, at::kHalf, nb, groups / span, "scales must be float16 [NB, K/32/span, 16]");
  check_params(shifts, at::kHalf, nb, groups / span, "shifts must be float16 [NB, K/32/span, 16]");
  check_params(sub, at::kChar, nb, 2 * groups, "sub must be int8 [NB, K/16, 16]");
  check_params(mins, at::kByte, nb, groups, "mins must be uint8 [NB, K/32, 16]");
  TORCH_CHECK(!mins.has_value() || shifts.has_value(), "mins need shifts");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "bias must be a contiguous float32 [N] tensor");
  return {low.data_ptr<uint8_t>(), data_or_null<uint8_t>(high), halves(scales),
          shifts.has_value() ? halves(*shifts) : nullptr, data_or_null<int8_t>(sub),
          data_or_null<uint8_t>(mins), K, groups, span, static_cast<int>(offset)};
}

void run_q8(const Blocks& w, const Problem& p, const float* xp, int64_t bits) {
  const Activations a = quantize_rows(xp, p.M, p.K);
  const int64_t block_bytes = w.low_bytes() * bits / 4;
  with_high_bits(bits, [&](auto E) {
    for_each_block(p, block_bytes, [&](int64_t b, int64_t m0, auto MT) {
      if (w.sub != nullptr)
        block_q8<decltype(E)::value, 2, decltype(MT)::value>(w, a, p, b, m0);
      else
        block_q8<decltype(E)::value, 1, decltype(MT)::value>(w, a, p, b, m0);
    });
  });
}

void run_f32(const Blocks& w, const Problem& p, const float* xp, int64_t bits) {
  std::vector<float> xsum(p.M * w.groups);
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t g = 0; g < w.groups; ++g) {
      float s = 0.f;
      for (int64_t k = g * kBlock; k < (g + 1) * kBlock; ++k) s += xp[m * p.K + k];
      xsum[m * w.groups + g] = s;
    }
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / (w.low_bytes() * bits / 4));
  with_high_bits(bits, [&](auto E) {
    at::parallel_for(0, p.nb, grain, [&](int64_t b0, int64_t b1) {
      std::vector<float> v(p.K * kLanes);
      for (int64_t b = b0; b < b1; ++b) {
        unpack<decltype(E)::value>(w, b, v.data());
        for (int64_t m0 = 0; m0 < p.M; m0 += kMaxRows)
          with_rows<kMaxRows>(static_cast<int>(std::min<int64_t>(kMaxRows, p.M - m0)), [&](auto MT) {
            block_f32<decltype(MT)::value>(w, v.data(), xp, xsum.data(), p, b, m0);
          });
      }
    });
  });
}

// Both ops' entry point: one argument list and one set of checks; ``Int8`` picks the
// activations (int8 in blocks of 32: ``linear_kq8``; float32: ``linear_kf32``).
template <bool Int8>
at::Tensor linear_k(const at::Tensor& x, const at::Tensor& low,
                    const c10::optional<at::Tensor>& high, const at::Tensor& scales,
                    const c10::optional<at::Tensor>& sub, const c10::optional<at::Tensor>& shifts,
                    const c10::optional<at::Tensor>& mins, int64_t bits, int64_t offset,
                    int64_t span, const c10::optional<at::Tensor>& bias, int64_t n) {
  const Blocks w = blocks(x, low, high, scales, sub, shifts, mins, bits, offset, span, bias, n);
  auto out = at::empty({x.size(0), n}, x.options());
  const Problem p{x.size(0), w.K, n, low.size(0), out.data_ptr<float>(), data_or_null<float>(bias)};
  if constexpr (Int8)
    run_q8(w, p, x.data_ptr<float>(), bits);
  else
    run_f32(w, p, x.data_ptr<float>(), bits);
  return out;
}

}  // namespace

#ifndef QLINEAR_NAMESPACE
#define QLINEAR_NAMESPACE prefixserve_cpu
#endif

TORCH_LIBRARY_FRAGMENT(QLINEAR_NAMESPACE, m) {
  m.def(
      "linear_kq8(Tensor x, Tensor low, Tensor? high, Tensor scales, Tensor? sub, Tensor? shifts, "
      "Tensor? mins, int bits, int offset, int span, Tensor? bias, int n) -> Tensor");
  m.def(
      "linear_kf32(Tensor x, Tensor low, Tensor? high, Tensor scales, Tensor? sub, Tensor? "
      "shifts, Tensor? mins, int bits, int offset, int span, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(QLINEAR_NAMESPACE, CPU, m) {
  m.impl("linear_kq8", &linear_k<true>);
  m.impl("linear_kf32", &linear_k<false>);
}
