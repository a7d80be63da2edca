// RMSNorm on CPU, and the residual add fused with it, for float32 rows:
//
//     rms_norm(x, w, eps)               out[r, d] = w[d] * (x[r, d] * inv_r)
//     add_rms_norm(x, residual, w, eps) sum = x + residual;  (rms_norm(sum, w, eps), sum)
//
//     inv_r = 1 / sqrt(ss_r / D + eps),   ss_r = sum_d x[r, d]^2
//
// x is [..., D] contiguous (every leading dim is a row); w is [D]. ss_r is summed in sixteen
// running sums over d ascending (lane d % 16), then added pairwise (0+8, 1+9, ... then 0+4, ...
// then 0+2, 1+3, then 0+1): a fixed order for every call.
//
// Invariant (batch invariance): a row's result depends on that row and w alone, through the same
// operation sequence whatever the number of rows. Eager and compiled steps both call these ops, so
// they give the same bits by construction.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16u __attribute__((vector_size(64), aligned(4)));

// sum_d x[d]^2 in the order the header states.
inline float sum_of_squares(const float* x, int64_t n) {
  f32x16 acc = {};
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    const f32x16 v = *reinterpret_cast<const f32x16u*>(x + d);
    acc += v * v;
  }
  for (int64_t j = 0; d < n; ++d, ++j) acc[j] += x[d] * x[d];
  for (int width = 8; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  return acc[0];
}

inline void normalize(const float* x, const float* w, float* out, int64_t n, float eps) {
  const float inv = 1.f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t d = 0; d < n; ++d) out[d] = w[d] * (x[d] * inv);
}

void check(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1,
              "x must be contiguous float32 [..., D]");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 1 &&
                  w.size(0) == x.size(-1),
              "weight must be float32 [D] with D = x.size(-1)");
}

// Rows in parallel, at least 16K floats a thread: a decode step's few rows stay on one thread.
template <typename F>
void for_rows(int64_t rows, int64_t dim, const F& f) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(dim, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) f(r);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check(x, w);
  auto out = at::empty_like(x);
  const int64_t dim = x.size(-1), rows = dim ? x.numel() / dim : 0;
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  for_rows(rows, dim, [&](int64_t r) { normalize(xp + r * dim, wp, op + r * dim, dim, e); });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& w, double eps) {
  check(x, w);
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() &&
                  residual.sizes() == x.sizes(),
              "residual must be contiguous float32 of x's shape");
  auto out = at::empty_like(x);
  auto sum = at::empty_like(x);
  const int64_t dim = x.size(-1), rows = dim ? x.numel() / dim : 0;
  const float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *op = out.data_ptr<float>(), *sp = sum.data_ptr<float>();
  const float e = static_cast<float>(eps);
  for_rows(rows, dim, [&](int64_t r) {
    float* s = sp + r * dim;
    for (int64_t d = 0; d < dim; ++d) s[d] = xp[r * dim + d] + rp[r * dim + d];
    normalize(s, wp, op + r * dim, dim, e);
  });
  return {out, sum};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(prefixserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
