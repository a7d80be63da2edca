// CPU linear kernels for decode: y[M, N] = x[M, K] W^T (+ bias), W stored in blocks of 16 output
// rows ("lanes"), each block K-major:
//
//     packed f32   [NB, K, 16]        block b, row k: W[16b .. 16b+15, k]
//     packed int8  [NB, K, 16] int8   w = q * scale[n, g]                   g = k / group
//     packed int4  [NB, K/2, 16] u8   w = q * scale[n, g] + shift[n, g]
//                                     byte (kk, lane): k = 2kk low nibble, 2kk + 1 high
//     scale, shift [NB, K/group, 16] float16
//
// A step of a few rows is bound by reading W once. The block layout streams it: per k one
// 64-byte line of weights is multiplied by each row's x[k] into that row's 16 accumulators, so
// each weight byte is read from memory once per call whatever M is (a block stays in L1/L2 while
// the row tiles take their turns). A tile holds its rows' accumulators in registers, so each
// weight line loaded serves every row of the tile: float32, up to 12 rows times 2 blocks on
// AVX-512 (6 rows times 1 block on AVX2); int8 / int4, up to 6 rows times 1 block.
//
// Invariant (batch invariance): output (m, n) is computed by the same sequence of floating-point
// operations whatever M is, wherever row m sits in x, whichever tile and thread compute it and
// whatever the vector width: k ascending into one accumulator (per group for int8/int4, each
// group's sum then scaled, and for int4 shifted, into the total), then the bias. So a row's
// result is bit-identical alone or in any batch, on any instruction set, and across the direct
// and the unpacked paths.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_rows.h"

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxTile = 6;  // int8 / int4: rows of x held in registers at once (12 ymm)

// 16 lanes as two 8-float vectors: the native width of AVX2 (GCC lowers wider generic vectors
// through the stack there); two NEON registers each elsewhere.
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x8u __attribute__((vector_size(32), aligned(4)));
typedef int8_t i8x8u __attribute__((vector_size(8), aligned(1)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef uint8_t u8x8u __attribute__((vector_size(8), aligned(1)));
typedef _Float16 f16x8u __attribute__((vector_size(16), aligned(2)));

struct f32x16 {
  f32x8 lo, hi;
  f32x16() : lo{}, hi{} {}
  f32x16(f32x8 l, f32x8 h) : lo(l), hi(h) {}
  f32x16 operator+(const f32x16& o) const { return {lo + o.lo, hi + o.hi}; }
  f32x16 operator*(const f32x16& o) const { return {lo * o.lo, hi * o.hi}; }
  f32x16 operator*(float s) const { return {lo * s, hi * s}; }
  f32x16& operator+=(const f32x16& o) { lo += o.lo; hi += o.hi; return *this; }
  // this += a * *s, one rounding (a fused multiply-add)
  void fma(const f32x16& a, const float* s);
  void fma(const f32x16& a, const f32x16& b);
};

inline f32x16 load(const float* p) {
  return {*reinterpret_cast<const f32x8u*>(p), *reinterpret_cast<const f32x8u*>(p + 8)};
}
inline void store_full(float* p, const f32x16& v) {
  *reinterpret_cast<f32x8u*>(p) = v.lo;
  *reinterpret_cast<f32x8u*>(p + 8) = v.hi;
}
// Conversions of codes to float. GCC scalarizes most widening vector conversions, so x86 gets
// them as intrinsics; elsewhere the generic vector code stands.
#if defined(__AVX2__) && defined(__F16C__)
inline f32x8 int8_to_float(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void nibbles_to_float(const uint8_t* p, f32x8& lo, f32x8& hi) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}
inline f32x8 half_to_float(const _Float16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#else
inline f32x8 int8_to_float(const int8_t* p) {
  return __builtin_convertvector(*reinterpret_cast<const i8x8u*>(p), f32x8);
}
inline void nibbles_to_float(const uint8_t* p, f32x8& lo, f32x8& hi) {
  const u8x8 v = *reinterpret_cast<const u8x8u*>(p);
  lo = __builtin_convertvector(v & 15, f32x8);
  hi = __builtin_convertvector(v >> 4, f32x8);
}
inline f32x8 half_to_float(const _Float16* p) {
  return __builtin_convertvector(*reinterpret_cast<const f16x8u*>(p), f32x8);
}
#endif

inline f32x16 load_half(const _Float16* p) { return {half_to_float(p), half_to_float(p + 8)}; }

// Fused multiply-adds, the only ones in this file: it builds with -ffp-contract=off, so every
// other product and sum rounds on its own and each output's operation sequence is the one written.
#if defined(__AVX2__) && defined(__FMA__)
inline f32x8 fma8(f32x8 a, f32x8 b, f32x8 c) { return _mm256_fmadd_ps(a, b, c); }
inline f32x8 broadcast(const float* s) { return _mm256_broadcast_ss(s); }
#else
inline f32x8 fma8(f32x8 a, f32x8 b, f32x8 c) {
  for (int j = 0; j < 8; ++j) c[j] = __builtin_fmaf(a[j], b[j], c[j]);
  return c;
}
inline f32x8 broadcast(const float* s) { return f32x8{*s, *s, *s, *s, *s, *s, *s, *s}; }
#endif
inline void f32x16::fma(const f32x16& a, const float* s) {
  const f32x8 v = broadcast(s);
  lo = fma8(a.lo, v, lo);
  hi = fma8(a.hi, v, hi);
}
inline void f32x16::fma(const f32x16& a, const f32x16& b) {
  lo = fma8(a.lo, b.lo, lo);
  hi = fma8(a.hi, b.hi, hi);
}

// The float32 tile's vector: one block of 16 lanes in a zmm register on AVX-512, half a block in a
// ymm register elsewhere. Its fma is one rounding per lane whatever the width, so both widths give
// the same bits.
#if defined(__AVX512F__)
typedef float fvec __attribute__((vector_size(64)));
typedef float fvec_u __attribute__((vector_size(64), aligned(4)));
inline fvec fma_v(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline fvec broadcast_v(const float* s) { return _mm512_set1_ps(*s); }
constexpr int64_t kVec = 16;
constexpr int kTileRows = 12;  // 24 accumulators, 2 weight vectors and a broadcast: 27 of 32 zmm
#else
typedef f32x8 fvec;
typedef f32x8u fvec_u;
inline fvec fma_v(fvec a, fvec b, fvec c) { return fma8(a, b, c); }
inline fvec broadcast_v(const float* s) { return broadcast(s); }
constexpr int64_t kVec = 8;
constexpr int kTileRows = 6;  // 12 accumulators, 2 weight vectors and a broadcast: 15 of 16 ymm
#endif
// How far ahead of its loads the float32 tile asks for weight lines (4 KiB, within the column it
// reads or into the next): at a few rows a tile spends longer on each line than the hardware
// prefetcher allows for, and the one-row rate held at eight rows only with it.
constexpr int64_t kPrefetchFloats = 1024;
constexpr int kTileVecs = 2;  // output vectors per float32 tile: 2 blocks on AVX-512, 1 elsewhere
// A call of one row (a one-stream decode step) reads its weights in units of kRowVecs vectors
// instead, without asking for lines ahead: one row spends little time on each weight line, and six
// independent accumulator chains over six streams kept two threads reading at 50 GB/s where two
// chains with the 4 KiB prefetch read at 46 (a C++ loop over SmolLM2's 121 matrices).
constexpr int kRowVecs = 6;

// The row tiles of a float32 call of M rows: as few as kTileRows allows, their sizes within one of
// each other (M = 13 on AVX-512: 7 + 6, not 12 + 1, whose one-row tile would wait on its fma
// latency). Any split gives the same bits: a tile's size changes which rows share a weight load,
// never an output's operations.
std::vector<int64_t> row_tiles(int64_t M) {
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  std::vector<int64_t> rows;
  for (int64_t t = 0; t < tiles; ++t) rows.push_back(M / tiles + (t < M % tiles ? 1 : 0));
  return rows;
}

// Writes lanes [0, width) of v to out (width < 16 only in a padded last block).
inline void store(float* out, f32x16 v, int64_t width) {
  if (width == kLanes) return store_full(out, v);
  float lanes[kLanes];
  store_full(lanes, v);
  std::copy(lanes, lanes + width, out);
}

// Where a tile reads block rows: ``row(k)`` is row k of the block as 16 floats, ``pair(kk)`` rows
// 2kk and 2kk + 1. Float rows are read as they are; int8 and int4 codes are converted to float on
// the fly (exactly: every code is a small integer).
struct FloatRows {
  const float* w;
  f32x16 row(int64_t k) const { return load(w + k * kLanes); }
  void pair(int64_t kk, f32x16& a, f32x16& b) const { a = row(2 * kk); b = row(2 * kk + 1); }
};
struct Int8Rows {
  const int8_t* q;
  f32x16 row(int64_t k) const {
    const int8_t* r = q + k * kLanes;
    return {int8_to_float(r), int8_to_float(r + 8)};
  }
  void pair(int64_t kk, f32x16& a, f32x16& b) const { a = row(2 * kk); b = row(2 * kk + 1); }
};
struct Int4Rows {  // byte (kk, lane): k = 2kk low nibble, 2kk + 1 high
  const uint8_t* q;
  void pair(int64_t kk, f32x16& a, f32x16& b) const {
    nibbles_to_float(q + kk * kLanes, a.lo, b.lo);
    nibbles_to_float(q + kk * kLanes + 8, a.hi, b.hi);
  }
};

// The float32 tile: MT rows of x, given k-major (``xt[k * MT + i]`` is row i's x[k]: one pointer
// for every row, where MT row pointers would spill), times NV vectors of output columns, each
// vector's weights read at ``col[j] + k * 16``; one accumulator per row and vector, all held in
// registers for the whole k loop, k ascending, so each weight vector loaded serves MT rows and
// each x[i, k] broadcast serves NV vectors. ``epilogue(i, j, acc)`` stores row i's vector j.
template <int MT, int NV, bool Prefetch, class Epilogue>
inline void float_tile(const float* xt, const float* const* col, int64_t K, Epilogue epilogue) {
  fvec acc[MT][NV] = {};
  for (int64_t k = 0; k < K; ++k) {
    fvec wk[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) {
      wk[j] = *reinterpret_cast<const fvec_u*>(col[j] + k * kLanes);
      if constexpr (Prefetch) __builtin_prefetch(col[j] + k * kLanes + kPrefetchFloats);
    }
#pragma GCC unroll 16
    for (int i = 0; i < MT; ++i) {
      const fvec xv = broadcast_v(xt + k * MT + i);
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) acc[i][j] = fma_v(wk[j], xv, acc[i][j]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MT; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) epilogue(i, j, acc[i][j]);
}

// One tile of the int8 / int4 kernels: rows [0, MT) of x (row stride ldx) times one block of W,
// each row's 16 accumulators held in registers (plain vector arrays: GCC keeps them in registers
// where it would spill a struct), the sums restarted every ``group`` columns, k ascending, two at
// a time; ``combine(i, g, part, acc)`` adds group g's partial sums to row i's accumulators,
// ``epilogue(i, acc)`` stores row i.
template <int MT, class Rows, class Combine, class Epilogue>
inline void grouped_tile(const float* x, int64_t ldx, const Rows& w, int64_t K, int64_t group,
                         Combine combine, Epilogue epilogue) {
  f32x16 acc[MT];
  for (int64_t g = 0; g < K / group; ++g) {
    f32x8 lo[MT] = {}, hi[MT] = {};
    for (int64_t kk = g * group / 2; kk < (g + 1) * group / 2; ++kk) {
      f32x16 w0, w1;
      w.pair(kk, w0, w1);
#pragma GCC unroll 6
      for (int i = 0; i < MT; ++i) {
        const f32x8 x0 = broadcast(x + i * ldx + 2 * kk), x1 = broadcast(x + i * ldx + 2 * kk + 1);
        lo[i] = fma8(w1.lo, x1, fma8(w0.lo, x0, lo[i]));
        hi[i] = fma8(w1.hi, x1, fma8(w0.hi, x0, hi[i]));
      }
    }
#pragma GCC unroll 6
    for (int i = 0; i < MT; ++i) combine(i, g, f32x16(lo[i], hi[i]), acc[i]);
  }
#pragma GCC unroll 6
  for (int i = 0; i < MT; ++i) epilogue(i, acc[i]);
}

struct Problem {
  const float* x;
  int64_t M, K, N;
  float* out;
  const float* bias;  // [N] or null

  int64_t width(int64_t b) const { return std::min(kLanes, N - b * kLanes); }
  f32x16 bias_of(int64_t b) const {
    float v[kLanes] = {};
    if (bias != nullptr)
      for (int64_t j = 0; j < width(b); ++j) v[j] = bias[b * kLanes + j];
    return load(v);
  }
};

// Every block of W, split among torch's threads; ``rows(b)`` is block b's reader (FloatRows,
// Int8Rows, Int4Rows). With more rows of x than one tile, a quantized block is first converted
// into a float scratch block (the same values, so the same sums), then every tile reads that.
// ``finish(b, m0, mt, rows)`` computes the outputs of rows [m0, m0 + mt) of x in block b.
template <class Rows, class Unpack, class Finish>
void for_each_block(const Problem& p, int64_t nb, Rows rows, Unpack unpack, Finish finish) {
  if (p.M == 0) return;  // no rows: nothing to write (a tile needs at least one)
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (p.K * kLanes));
  at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> scratch;
    for (int64_t b = b0; b < b1; ++b) {
      const auto direct = rows(b);
      if (p.M <= kMaxTile) {
        finish(b, 0, static_cast<int>(p.M), direct);
        continue;
      }
      scratch.resize(p.K * kLanes);
      unpack(direct, scratch.data());
      const FloatRows unpacked{scratch.data()};
      for (int64_t m0 = 0; m0 < p.M; m0 += kMaxTile)
        finish(b, m0, static_cast<int>(std::min(kMaxTile, p.M - m0)), unpacked);
    }
  });
}

void check_input(const at::Tensor& x, const c10::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "bias must be a contiguous float32 [N] tensor");
}

Problem problem(const at::Tensor& x, at::Tensor& out, const c10::optional<at::Tensor>& bias,
                int64_t n) {
  return {x.data_ptr<float>(), x.size(0), x.size(1), n, out.data_ptr<float>(),
          bias.has_value() ? bias->data_ptr<float>() : nullptr};
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                      int64_t n) {
  check_input(x, bias, n);
  TORCH_CHECK(w.dim() == 3 && w.size(1) == x.size(1) && w.size(2) == kLanes &&
                  w.scalar_type() == at::kFloat && w.is_contiguous(),
              "w must be packed float32 [N/16, K, 16]");
  auto out = at::empty({x.size(0), n}, x.options());
  const Problem p = problem(x, out, bias, n);
  const float* wp = w.data_ptr<float>();
  const std::vector<int64_t> rows = row_tiles(p.M);
  // x, each row tile k-major (the tile of rows [m0, m0 + mt) at xt + m0 * K): exact copies
  std::vector<float> xt(p.M * p.K);
  for (int64_t m0 = 0, t = 0; m0 < p.M; m0 += rows[t++])
    for (int64_t i = 0; i < rows[t]; ++i)
      for (int64_t k = 0; k < p.K; ++k) xt[m0 * p.K + k * rows[t] + i] = p.x[(m0 + i) * p.K + k];
  // Output columns [0, NB * 16) in units of one tile's vectors (the last unit may hold fewer),
  // split among torch's threads; each unit's weights are read from memory once, then from cache
  // while its row tiles take their turns.
  const int vecs = p.M == 1 ? kRowVecs : kTileVecs;
  const int64_t width = vecs * kVec, padded = w.size(0) * kLanes;
  const int64_t units = (padded + width - 1) / width;
  at::parallel_for(0, units, std::max<int64_t>(1, (int64_t{1} << 16) / (p.K * width)),
                   [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t c0 = u * width;
      const int nv = static_cast<int>(std::min<int64_t>(vecs, (padded - c0) / kVec));
      const float* col[kRowVecs];
      fvec bv[kRowVecs] = {};
      for (int j = 0; j < nv; ++j) {
        const int64_t c = c0 + j * kVec;
        col[j] = wp + (c / kLanes) * p.K * kLanes + c % kLanes;
        for (int64_t l = 0; l < kVec && c + l < n; ++l) bv[j][l] = p.bias ? p.bias[c + l] : 0.f;
      }
      int64_t m0 = 0;
      for (const int64_t mt : rows) {
        float* out = p.out + m0 * n;
        auto epilogue = [&](int i, int j, fvec a) {
          const int64_t c = c0 + j * kVec, valid = std::min<int64_t>(kVec, n - c);
          a += bv[j];
          if (valid == kVec)
            *reinterpret_cast<fvec_u*>(out + i * n + c) = a;
          else  // the padded last block: its lanes past N (none, or all of a vector) stay unwritten
            for (int64_t l = 0; l < valid; ++l) out[i * n + c + l] = a[l];
        };
        if (p.M == 1)
          with_rows<kRowVecs>(nv, [&](auto NV) {
            float_tile<1, NV, false>(xt.data(), col, p.K, epilogue);
          });
        else
          with_rows<kTileRows>(static_cast<int>(mt), [&](auto MT) {
            if (nv == kTileVecs)
              float_tile<MT, kTileVecs, true>(xt.data() + m0 * p.K, col, p.K, epilogue);
            else
              float_tile<MT, 1, true>(xt.data() + m0 * p.K, col, p.K, epilogue);
          });
        m0 += mt;
      }
    }
  });
  return out;
}

// The row tiles linear_f32 runs for m rows (the decision its tests check).
std::vector<int64_t> linear_f32_row_tiles(int64_t m) { return row_tiles(m); }

// Checks a float16 [NB, K/group, 16] group-parameter tensor.
void check_groups(const at::Tensor& t, int64_t nb, int64_t groups) {
  TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 3 && t.size(0) == nb &&
                  t.size(1) == groups && t.size(2) == kLanes,
              "scales and shifts must be float16 [N/16, K/group, 16]");
}

// Each row of x's sums over each group of columns, k ascending (what int4 shifts multiply).
std::vector<float> group_sums(const Problem& p, int64_t group) {
  const int64_t groups = p.K / group;
  std::vector<float> sums(p.M * groups);
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) s += p.x[m * p.K + k];
      sums[m * groups + g] = s;
    }
  return sums;
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       int64_t group, const c10::optional<at::Tensor>& bias, int64_t n) {
  check_input(x, bias, n);
  const int64_t K = x.size(1);
  TORCH_CHECK(group > 0 && group % 2 == 0 && K % group == 0, "K must be a multiple of the group");
  TORCH_CHECK(w.dim() == 3 && w.size(1) == K && w.size(2) == kLanes &&
                  w.scalar_type() == at::kChar && w.is_contiguous(),
              "w must be packed int8 [N/16, K, 16]");
  const int64_t groups = K / group, nb = w.size(0);
  check_groups(scales, nb, groups);
  auto out = at::empty({x.size(0), n}, x.options());
  const Problem p = problem(x, out, bias, n);
  const int8_t* wp = w.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const _Float16*>(scales.data_ptr<at::Half>());
  for_each_block(
      p, nb, [&](int64_t b) { return Int8Rows{wp + b * K * kLanes}; },
      [&](const Int8Rows& rows, float* scratch) {
        for (int64_t k = 0; k < K; ++k) store_full(scratch + k * kLanes, rows.row(k));
      },
      [&](int64_t b, int64_t m0, int mt, const auto& rows) {
        const _Float16* sb = sp + b * groups * kLanes;
        const f32x16 bv = p.bias_of(b);
        float* out = p.out + m0 * n + b * kLanes;
        with_rows<kMaxTile>(mt, [&](auto MT) {
          grouped_tile<MT>(
              p.x + m0 * K, K, rows, K, group,
              [&](int, int64_t g, const f32x16& part, f32x16& acc) {
                acc.fma(part, load_half(sb + g * kLanes));
              },
              [&](int i, f32x16 a) { store(out + i * n, a + bv, p.width(b)); });
        });
      });
  return out;
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       const at::Tensor& shifts, int64_t group, const c10::optional<at::Tensor>& bias,
                       int64_t n) {
  check_input(x, bias, n);
  const int64_t K = x.size(1);
  TORCH_CHECK(group > 0 && group % 2 == 0 && K % group == 0, "K must be a multiple of the group");
  TORCH_CHECK(w.dim() == 3 && w.size(1) * 2 == K && w.size(2) == kLanes &&
                  w.scalar_type() == at::kByte && w.is_contiguous(),
              "w must be packed uint8 [N/16, K/2, 16]");
  const int64_t groups = K / group, nb = w.size(0);
  check_groups(scales, nb, groups);
  check_groups(shifts, nb, groups);
  auto out = at::empty({x.size(0), n}, x.options());
  const Problem p = problem(x, out, bias, n);
  const std::vector<float> xsum = group_sums(p, group);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const _Float16*>(scales.data_ptr<at::Half>());
  const auto* hp = reinterpret_cast<const _Float16*>(shifts.data_ptr<at::Half>());
  for_each_block(
      p, nb, [&](int64_t b) { return Int4Rows{wp + b * (K / 2) * kLanes}; },
      [&](const Int4Rows& rows, float* scratch) {
        for (int64_t kk = 0; kk < K / 2; ++kk) {
          f32x16 a, c;
          rows.pair(kk, a, c);
          store_full(scratch + 2 * kk * kLanes, a);
          store_full(scratch + (2 * kk + 1) * kLanes, c);
        }
      },
      [&](int64_t b, int64_t m0, int mt, const auto& rows) {
        const _Float16* sb = sp + b * groups * kLanes;
        const _Float16* hb = hp + b * groups * kLanes;
        const f32x16 bv = p.bias_of(b);
        const float* xs = xsum.data() + m0 * groups;
        float* out = p.out + m0 * n + b * kLanes;
        with_rows<kMaxTile>(mt, [&](auto MT) {
          grouped_tile<MT>(
              p.x + m0 * K, K, rows, K, group,
              [&](int i, int64_t g, const f32x16& part, f32x16& acc) {
                acc.fma(part, load_half(sb + g * kLanes));  // + code sums * scale
                acc.fma(load_half(hb + g * kLanes), xs + i * groups + g);  // + x sum * shift
              },
              [&](int i, f32x16 a) { store(out + i * n, a + bv, p.width(b)); });
        });
      });
  return out;
}

}  // namespace

// The ops' namespace: prefixserve_cpu in the engine's build; tests/test_cpu_linear.py builds this
// file for other instruction sets (-march) into namespaces of their own and compares the bits.
#ifndef LINEAR_NAMESPACE
#define LINEAR_NAMESPACE prefixserve_cpu
#endif

TORCH_LIBRARY_FRAGMENT(LINEAR_NAMESPACE, m) {
  m.def("linear_f32(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor");
  m.def("linear_f32_row_tiles(int m) -> int[]", &linear_f32_row_tiles);
  m.def("linear_int8(Tensor x, Tensor w, Tensor scales, int group, Tensor? bias, int n) -> Tensor");
  m.def(
      "linear_int4(Tensor x, Tensor w, Tensor scales, Tensor shifts, int group, Tensor? bias, "
      "int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(LINEAR_NAMESPACE, CPU, m) {
  m.impl("linear_f32", &linear_f32);
  m.impl("linear_int8", &linear_int8);
  m.impl("linear_int4", &linear_int4);
}
