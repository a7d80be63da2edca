// How fast can two threads read SmolLM2-135M's float32 weights (538 MB) on this machine? A
// standalone measurement of the read roofline a one-stream float32 decode step is bound by, in
// the shapes of the step's 121 matrices (30 layers of qkv 960x576, o 576x576, gate/up 3072x576,
// down 576x1536, and the 49152x576 lm_head), one after another as a step reads them.
//
// Built and run by benchmarks/read_roofline.py (g++ -O3 -march=native -fopenmp); prints one JSON
// line per variant: {"name", "pages", "median_ms", "best_ms", "best_gbs"} (ms per 538 MB over the
// passes after one warm-up). Each variant is one way to
// read the same bytes; the variants take turns pass by pass:
//   flat-*         one parallel region, each thread reads its half of the whole buffer (no
//                  per-matrix synchronisation: the upper bound)
//   halves-*       per matrix, each thread reads one contiguous half (a barrier between matrices)
//   chunks-*       per matrix, 147 KB chunks (64 rows of 576 floats, llama.cpp's one-row split)
//                  taken in turn by the threads
//   streams<S>-*   per matrix, halves, each thread reading S blocks of [K, 16] floats at once, one
//                  64-byte line of each per k (prefixserve's packed one-row kernel: S = 6)
//   ...-sum        8 independent vaddps accumulators (pure read)
//   ...-fma        S fma chains against a cached x[k] broadcast (the kernel's arithmetic)
//   ...-il6        6 blocks interleaved per k ([K, 96] units): one stream, 6 fma chains
//   ...-rowdot     row-major rows dotted with x, 4 accumulators and a reduction per row (ggml)
//   ...-pf<D>      prefetcht0 D bytes ahead;  -nta<D>: prefetchnta D bytes ahead
//   ...-sticky24   the step's first 24 MB read as usual, the rest through prefetchnta: do
//                  non-temporal reads leave the first 24 MB in the 32 MB L3 for the next pass?
//                  (run it alone: other variants' passes in between evict it)
//   ...-fork       a new OpenMP parallel region per matrix (at::parallel_for) instead of one
//                  region with barriers
// Pages (argv[1]): "2M", anonymous memory on 2 MiB transparent huge pages (madvise); "4k", the same
// on 4 KiB pages (MADV_NOHUGEPAGE); else a file's first 538 MB mapped shared, from the page cache
// (as llama.cpp maps a GGUF: its offsets are not the tensors', the bytes read are as many).
// argv[2]: passes; argv[3]: run only the variants whose name contains one of these comma-separated
// strings.
#include <immintrin.h>
#include <omp.h>
#include <fcntl.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

struct Matrix {
  const float* w;
  int64_t n, k;
  int64_t bytes() const { return n * k * 4; }
};

float g_sink[64];  // results land here so that no read is optimised away

// Sum of [p, p + bytes) with 8 independent accumulators; prefetch ``dist`` bytes ahead (0: none).
template <int Hint>
float read_sum(const char* p, int64_t bytes, int64_t dist) {
  __m512 a[8];
  for (auto& v : a) v = _mm512_setzero_ps();
  for (int64_t o = 0; o < bytes; o += 512) {
    if (dist) _mm_prefetch(p + o + dist, static_cast<_mm_hint>(Hint));
    if (dist) _mm_prefetch(p + o + dist + 256, static_cast<_mm_hint>(Hint));
    for (int j = 0; j < 8; ++j) a[j] = _mm512_add_ps(a[j], _mm512_load_ps(p + o + 64 * j));
  }
  for (int j = 1; j < 8; ++j) a[0] = _mm512_add_ps(a[0], a[j]);
  return _mm512_reduce_add_ps(a[0]);
}

// [p, p + bytes) as units of [k, 96] floats (6 blocks of 16 output rows interleaved per k) times
// a cached x: one sequential stream, 6 fma chains against x[k] broadcast (a one-row matvec on an
// interleaved packed layout).
float read_il6(const char* p, int64_t bytes, const float* x, int64_t k, int64_t dist) {
  __m512 a[6], tot = _mm512_setzero_ps();
  for (auto& v : a) v = _mm512_setzero_ps();
  int64_t kk = 0;
  for (int64_t o = 0; o + 384 <= bytes; o += 384) {
    const __m512 xv = _mm512_set1_ps(x[kk]);
    if (dist) {
      for (int j = 0; j < 384; j += 64) _mm_prefetch(p + o + j + dist, _MM_HINT_T0);
    }
    for (int j = 0; j < 6; ++j) a[j] = _mm512_fmadd_ps(_mm512_load_ps(p + o + 64 * j), xv, a[j]);
    if (++kk == k) {
      kk = 0;
      for (int j = 0; j < 6; ++j) tot = _mm512_add_ps(tot, a[j]), a[j] = _mm512_setzero_ps();
    }
  }
  return _mm512_reduce_add_ps(tot);
}

// [p, p + bytes) as row-major rows of k floats, each dotted with a cached x by 4 accumulators of
// 16 lanes and reduced (ggml's ggml_vec_dot_f32 on AVX-512).
float read_rowdot(const char* p, int64_t bytes, const float* x, int64_t k) {
  float s = 0;
  const auto* w = reinterpret_cast<const float*>(p);
  for (int64_t r = 0; r < bytes / (4 * k); ++r) {
    __m512 a[4];
    for (auto& v : a) v = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 64)
      for (int j = 0; j < 4; ++j)
        a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(w + r * k + i + 16 * j), _mm512_loadu_ps(x + i + 16 * j), a[j]);
    s += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
  }
  return s;
}

// S blocks of a packed [NB, K, 16] matrix from ``col``, one line of each per k, each block's line
// into its own fma chain (prefixserve's one-row kernel); prefetch ``dist`` bytes ahead (0: none).
template <int S>
__m512 blocks_dot(const float* col, int64_t k, const float* x, int64_t dist) {
  __m512 a[S];
#pragma GCC unroll 16
  for (int j = 0; j < S; ++j) a[j] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const __m512 xv = _mm512_set1_ps(x[kk]);
#pragma GCC unroll 16
    for (int j = 0; j < S; ++j) {
      if (dist) _mm_prefetch(reinterpret_cast<const char*>(col + j * k * 16 + kk * 16) + dist, _MM_HINT_T0);
      a[j] = _mm512_fmadd_ps(_mm512_load_ps(col + j * k * 16 + kk * 16), xv, a[j]);
    }
  }
#pragma GCC unroll 16
  for (int j = 1; j < S; ++j) a[0] = _mm512_add_ps(a[0], a[j]);
  return a[0];
}

// Blocks [b0, b1), S at a time (the last few one at a time).
template <int S>
float read_streams(const float* w, int64_t k, int64_t b0, int64_t b1, const float* x, int64_t dist) {
  __m512 tot = _mm512_setzero_ps();
  int64_t b = b0;
  for (; b + S <= b1; b += S) tot = _mm512_add_ps(tot, blocks_dot<S>(w + b * k * 16, k, x, dist));
  for (; b < b1; ++b) tot = _mm512_add_ps(tot, blocks_dot<1>(w + b * k * 16, k, x, dist));
  return _mm512_reduce_add_ps(tot);
}

using Body = std::function<float(const Matrix&, int tid, int nth, std::atomic<int64_t>& next)>;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ms of one pass over all matrices; fork: one parallel region per matrix, else one region with a
// barrier after each matrix.
double time_pass(const std::vector<Matrix>& ms, const Body& body, bool fork) {
  std::vector<std::atomic<int64_t>> next(ms.size());
  for (auto& n : next) n.store(0);
  const double t0 = now();
  if (fork) {
    for (size_t i = 0; i < ms.size(); ++i) {
#pragma omp parallel
      g_sink[omp_get_thread_num()] += body(ms[i], omp_get_thread_num(), omp_get_num_threads(), next[i]);
    }
  } else {
#pragma omp parallel
    {
      float s = 0;
      for (size_t i = 0; i < ms.size(); ++i) {
        s += body(ms[i], omp_get_thread_num(), omp_get_num_threads(), next[i]);
#pragma omp barrier
      }
      g_sink[omp_get_thread_num()] += s;
    }
  }
  return 1e3 * (now() - t0);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string pages = argc > 1 ? argv[1] : "2M";  // 2M, 4k, or a file to map (page cache)
  const bool small_pages = pages == "4k";
  const int passes = argc > 2 ? std::atoi(argv[2]) : 15;
  const std::string only = argc > 3 ? argv[3] : "";
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (int l = 0; l < 30; ++l)
    for (auto s : {std::pair<int64_t, int64_t>{960, 576}, {576, 576}, {3072, 576}, {576, 1536}})
      shapes.push_back(s);
  shapes.push_back({49152, 576});
  int64_t total = 0;
  for (auto [n, k] : shapes) total += n * k * 4;
  const int64_t huge = 2 << 20;
  char* base;
  if (pages == "2M" || pages == "4k") {
    char* raw = static_cast<char*>(mmap(nullptr, total + huge, PROT_READ | PROT_WRITE,
                                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    base = raw + (-reinterpret_cast<intptr_t>(raw) & (huge - 1));
    madvise(base, total, small_pages ? MADV_NOHUGEPAGE : MADV_HUGEPAGE);
    for (int64_t i = 0; i < total / 4; ++i) reinterpret_cast<float*>(base)[i] = static_cast<float>(i % 7) * 0.125f;
  } else {  // the first bytes of a file of at least 538 MB, mapped as llama.cpp maps a GGUF
    const int fd = open(pages.c_str(), O_RDONLY);
    base = static_cast<char*>(mmap(nullptr, total, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0));
    if (fd < 0 || base == MAP_FAILED) return std::fprintf(stderr, "cannot map %s\n", pages.c_str()), 1;
  }
  std::vector<Matrix> ms;
  int64_t off = 0;
  for (auto [n, k] : shapes) {
    ms.push_back({reinterpret_cast<const float*>(base + off), n, k});
    off += n * k * 4;
  }
  std::vector<float> x(1536, 0.5f);
  const float* xp = x.data();

  auto half = [](const Matrix& m, int tid, int nth, int64_t unit, int64_t& lo, int64_t& hi) {
    const int64_t units = m.bytes() / unit;
    lo = units * tid / nth * unit;
    hi = units * (tid + 1) / nth * unit;
  };
  std::vector<std::pair<std::string, std::pair<Body, bool>>> variants;
  auto add = [&](const std::string& name, Body b, bool fork = false) { variants.push_back({name, {b, fork}}); };

  // flat: the whole buffer as one region per thread, synchronised only per pass
  add("flat-sum", [&](const Matrix& m, int tid, int nth, std::atomic<int64_t>&) -> float {
    if (&m != &ms[0]) return 0.f;
    const int64_t lo = total / 512 * tid / nth * 512, hi = total / 512 * (tid + 1) / nth * 512;
    return read_sum<_MM_HINT_T0>(base + lo, hi - lo, 0);
  });
  for (int64_t dist : {0, 1024, 4096, 8192, 16384}) {
    const std::string d = dist ? "-pf" + std::to_string(dist) : "";
    add("halves-sum" + d, [&, dist](const Matrix& m, int tid, int nth, std::atomic<int64_t>&) -> float {
      int64_t lo, hi;
      half(m, tid, nth, 512, lo, hi);
      return read_sum<_MM_HINT_T0>(reinterpret_cast<const char*>(m.w) + lo, hi - lo, dist);
    });
  }
  add("halves-sum-nta1024", [&](const Matrix& m, int tid, int nth, std::atomic<int64_t>&) -> float {
    int64_t lo, hi;
    half(m, tid, nth, 512, lo, hi);
    return read_sum<_MM_HINT_NTA>(reinterpret_cast<const char*>(m.w) + lo, hi - lo, 1024);
  });
  for (int64_t mb : {24}) {
    add("halves-sum-sticky" + std::to_string(mb), [&, mb](const Matrix& m, int tid, int nth, std::atomic<int64_t>&) -> float {
      int64_t lo, hi;
      half(m, tid, nth, 512, lo, hi);
      const char* p = reinterpret_cast<const char*>(m.w);
      if (p - base < mb << 20) return read_sum<_MM_HINT_T0>(p + lo, hi - lo, 4096);
      return read_sum<_MM_HINT_NTA>(p + lo, hi - lo, 1024);
    });
  }
  add("halves-sum-fork", [&](const Matrix& m, int tid, int nth, std::atomic<int64_t>&) -> float {
    int64_t lo, hi;
    half(m, tid, nth, 512, lo, hi);
    return read_sum<_MM_HINT_T0>(reinterpret_cast<const char*>(m.w) + lo, hi - lo, 0);
  }, true);
  for (int64_t dist : {0, 4096}) {
    add("halves-il6" + (dist ? "-pf" + std::to_string(dist) : std::string()),
        [&, dist](const Matrix& m, int tid, int nth, std::atomic<int64_t>&) -> float {
          int64_t lo, hi;
          half(m, tid, nth, 384 * m.k, lo, hi);
          return read_il6(reinterpret_cast<const char*>(m.w) + lo, hi - lo, xp, m.k, dist);
        });
  }
  add("halves-rowdot", [&](const Matrix& m, int tid, int nth, std::atomic<int64_t>&) -> float {
    int64_t lo, hi;
    half(m, tid, nth, 4 * m.k, lo, hi);
    return read_rowdot(reinterpret_cast<const char*>(m.w) + lo, hi - lo, xp, m.k);
  });
  // llama.cpp's split of a one-row matvec: chunks of 64 rows, thread t starts at chunk t, then
  // each takes the next free one
  add("chunks-sum", [&](const Matrix& m, int tid, int nth, std::atomic<int64_t>& next) -> float {
    const int64_t chunk = 64 * m.k * 4, chunks = (m.bytes() + chunk - 1) / chunk;
    float s = 0;
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1))
      s += read_sum<_MM_HINT_T0>(reinterpret_cast<const char*>(m.w) + c * chunk,
                                 std::min(chunk, m.bytes() - c * chunk), 0);
    (void)tid, (void)nth;
    return s;
  });
  add("chunks-rowdot", [&](const Matrix& m, int tid, int nth, std::atomic<int64_t>& next) -> float {
    const int64_t chunk = 64 * m.k * 4, chunks = (m.bytes() + chunk - 1) / chunk;
    float s = 0;
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1))
      s += read_rowdot(reinterpret_cast<const char*>(m.w) + c * chunk, std::min(chunk, m.bytes() - c * chunk), xp, m.k);
    (void)tid, (void)nth;
    return s;
  });
  auto streams = [&](auto S, int64_t dist, bool fork) {
    constexpr int s = decltype(S)::value;
    add("streams" + std::to_string(s) + "-fma" + (dist ? "-pf" + std::to_string(dist) : "") + (fork ? "-fork" : ""),
        [&, dist](const Matrix& m, int tid, int nth, std::atomic<int64_t>&) -> float {
          const int64_t nb = m.n / 16, units = (nb + s - 1) / s;
          const int64_t u0 = units * tid / nth, u1 = units * (tid + 1) / nth;
          return read_streams<s>(m.w, m.k, u0 * s, std::min(nb, u1 * s), xp, dist);
        }, fork);
  };
  streams(std::integral_constant<int, 1>{}, 0, false);
  streams(std::integral_constant<int, 1>{}, 4096, false);
  streams(std::integral_constant<int, 2>{}, 0, false);
  streams(std::integral_constant<int, 2>{}, 4096, false);
  streams(std::integral_constant<int, 3>{}, 4096, false);
  streams(std::integral_constant<int, 6>{}, 0, false);
  streams(std::integral_constant<int, 6>{}, 0, true);
  streams(std::integral_constant<int, 6>{}, 1024, false);
  streams(std::integral_constant<int, 6>{}, 4096, false);
  streams(std::integral_constant<int, 12>{}, 0, false);

  // the variants take turns pass by pass, so that a busy moment of the machine hits them alike
  std::vector<size_t> chosen;
  for (size_t i = 0; i < variants.size(); ++i) {
    bool take = only.empty();
    for (size_t a = 0, b; !take && a <= only.size(); a = b + 1) {
      b = std::min(only.find(',', a), only.size());
      take = variants[i].first.find(only.substr(a, b - a)) != std::string::npos;
    }
    if (take) chosen.push_back(i);
  }
  std::vector<std::vector<double>> times(variants.size());
  for (int pass = 0; pass <= passes; ++pass)
    for (size_t i : chosen) {
      const double t = time_pass(ms, variants[i].second.first, variants[i].second.second);
      if (pass) times[i].push_back(t);  // pass 0 warms up
    }
  for (size_t i : chosen) {
    auto& t = times[i];
    std::sort(t.begin(), t.end());
    std::printf("{\"name\": \"%s\", \"pages\": \"%s\", \"median_ms\": %.3f, \"best_ms\": %.3f, \"best_gbs\": %.1f}\n",
                variants[i].first.c_str(), pages.c_str(), t[t.size() / 2], t[0], total / t[0] / 1e6);
  }
  return 0;
}
