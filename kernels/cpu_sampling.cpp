// Which rows of a step's logits [N, V] (float32, contiguous) are all finite: the check that fails
// a request whose logits hold NaN or an infinity before sampling reads them.
//
//     finite_rows(logits)[r] = every logits[r, v] is finite
//
// Each row is read once, by one thread, summing v * 0 in sixteen lanes: the sum is NaN exactly
// when some v is NaN or infinite (inf * 0 is NaN), and 0 otherwise. Rows are split across threads
// only in batches of kRowsPerTask, so a decode step's few rows run on the calling thread without
// waking the OpenMP team (torch's two reductions for the same check took ~100 us a step there).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16u __attribute__((vector_size(64), aligned(4)));

constexpr int64_t kRowsPerTask = 8;

bool row_is_finite(const float* x, int64_t n) {
  f32x16 acc = {};
  int64_t v = 0;
  for (; v + 16 <= n; v += 16) acc += *reinterpret_cast<const f32x16u*>(x + v) * 0.0f;
  float tail = 0.0f;
  for (; v < n; ++v) tail += x[v] * 0.0f;
  for (int j = 0; j < 16; ++j) tail += acc[j];
  return !std::isnan(tail);
}

at::Tensor finite_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be a contiguous float32 [N, V] tensor");
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kBool));
  const float* x = logits.data_ptr<float>();
  bool* finite = out.data_ptr<bool>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) finite[r] = row_is_finite(x + r * n, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixserve_cpu, m) { m.def("finite_rows(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(prefixserve_cpu, CPU, m) { m.impl("finite_rows", &finite_rows); }
