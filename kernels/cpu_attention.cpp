// Paged attention on CPU, one query token at a time: the step's new K/V is written into the paged
// cache, then every query token attends to its context there, positions 0 .. len - 1 of its
// sequence (its own position last: causal by construction).
//
//     q            [T, nh, hd]  float32        the step's query tokens
//     k, v         [T, nkv, hd]                their new K/V
//     kv_cache     [2, NB, bs, nkv, hd]        one layer's cache (0: K, 1: V), written in place
//     slot_mapping [T] int64                   where each new K/V goes (-1: nowhere)
//     block_tables [S, W] int32                the step's sequences' block tables
//     token_seq    [T] int32, token_len [T] int32   each token's sequence (a row of block_tables)
//                                              and context length (its position + 1)
//
// A decode step is T = S tokens, token t of sequence t, len = seq_lens[t]. Sequence s's position
// p lives in block block_tables[s][p / bs], row p % bs. Per token and KV head the kernel scores
// the head's query heads against every position (one pass over K), takes a softmax per query
// head (max, then exp and sum, positions ascending) and sums the weighted V rows (one pass over
// V, positions ascending); a work item is one token's KV heads together (each cached row read
// whole, once per pass) or, with fewer tokens than threads to keep busy, one KV head of a token.
//
// Invariant (batch invariance): a token's output depends on its query, its context length and
// the K/V there alone, through the same operation sequence whatever else the step holds, how
// its sequence's prompt was chunked, or where the token sits in the step.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x8u __attribute__((vector_size(32), aligned(4)));

// sum_d a[d] * b[d]: eight running sums over d ascending (the last hd % 8 terms in the first ones),
// then added pairwise (0+4, 1+5, ... then 0+2, 1+3, then 0+1): a fixed order for every call.
inline float dot(const float* a, const float* b, int64_t n) {
  f32x8 acc = {};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    acc += *reinterpret_cast<const f32x8u*>(a + d) * *reinterpret_cast<const f32x8u*>(b + d);
  for (int64_t j = 0; d < n; ++d, ++j) acc[j] += a[d] * b[d];
  float r[4] = {acc[0] + acc[4], acc[1] + acc[5], acc[2] + acc[6], acc[3] + acc[7]};
  return (r[0] + r[2]) + (r[1] + r[3]);
}

// o[d] += w * v[d] for d ascending (a product, then a sum: no fused multiply-add), 16 at a time.
inline void add_scaled(float* o, const float* v, float w, int64_t n) {
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    f32x8u* o8 = reinterpret_cast<f32x8u*>(o + d);
    const f32x8u* v8 = reinterpret_cast<const f32x8u*>(v + d);
    o8[0] = o8[0] + v8[0] * w;
    o8[1] = o8[1] + v8[1] * w;
  }
  for (; d < n; ++d) o[d] += w * v[d];
}

// How many positions ahead the passes over the cache ask for rows (they sit in scattered blocks).
constexpr int64_t kAhead = 4;

// Asks for the cache lines of n floats from p.
inline void prefetch_row(const float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i);
}

void check(const at::Tensor& t, at::ScalarType type, int64_t dim, const char* what) {
  TORCH_CHECK(t.scalar_type() == type && t.dim() == dim && t.is_contiguous(), what);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                           const at::Tensor& block_tables, const at::Tensor& token_seq,
                           const at::Tensor& token_len, double scale) {
  check(q, at::kFloat, 3, "q must be contiguous float32 [T, heads, head_dim]");
  check(k, at::kFloat, 3, "k must be contiguous float32 [T, kv_heads, head_dim]");
  check(v, at::kFloat, 3, "v must be contiguous float32 [T, kv_heads, head_dim]");
  check(kv_cache, at::kFloat, 5, "kv_cache must be contiguous float32 [2, blocks, bs, kv_heads, hd]");
  check(slot_mapping, at::kLong, 1, "slot_mapping must be int64 [T]");
  check(block_tables, at::kInt, 2, "block_tables must be int32 [S, W]");
  check(token_seq, at::kInt, 1, "token_seq must be int32 [T]");
  check(token_len, at::kInt, 1, "token_len must be int32 [T]");
  const int64_t B = q.size(0), nh = q.size(1), hd = q.size(2), nkv = k.size(1);
  const int64_t nb = kv_cache.size(1), bs = kv_cache.size(2), W = block_tables.size(1);
  const int64_t S = block_tables.size(0);
  TORCH_CHECK(nh % nkv == 0 && kv_cache.size(3) == nkv && kv_cache.size(4) == hd &&
                  k.size(0) == B && v.sizes() == k.sizes() && slot_mapping.size(0) == B &&
                  token_seq.size(0) == B && token_len.size(0) == B,
              "paged_attention: inconsistent shapes");
  const int64_t group = nh / nkv, row = nkv * hd;  // floats per cached token
  float* kc = kv_cache.data_ptr<float>();
  float* vc = kc + nb * bs * row;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // the new K/V first: every query reads its own token
    if (slots[b] < 0) continue;
    TORCH_CHECK(slots[b] < nb * bs, "slot_mapping out of the cache");
    std::copy_n(k.data_ptr<float>() + b * row, row, kc + slots[b] * row);
    std::copy_n(v.data_ptr<float>() + b * row, row, vc + slots[b] * row);
  }
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* seqs = token_seq.data_ptr<int32_t>();
  const int32_t* lens = token_len.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(seqs[b] >= 0 && seqs[b] < S && lens[b] >= 1 && lens[b] <= W * bs,
                "token_seq / token_len out of the block tables");
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  // Work items: a token's KV heads all at once where the step has tokens enough to keep every
  // thread busy (each cached row is then read whole, in order: 768 contiguous bytes for
  // SmolLM2, where one head's 256 left the hardware prefetcher a strided pattern), else one KV
  // head of a token each. Which item computes an output never changes its operations.
  const int64_t heads = B >= 2 * at::get_num_threads() ? nkv : 1, per_token = nkv / heads;
  at::parallel_for(0, B * per_token, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / per_token, h0 = w % per_token * heads, len = lens[b];
      const int32_t* table = tables + seqs[b] * W;
      const auto cached = [&](int64_t p) { return ((int64_t)table[p / bs] * bs + p % bs) * row; };
      const float* qb = qp + (b * nh + h0 * group) * hd;  // the item's query heads, [heads * group, hd]
      const int64_t rows = heads * group;                  // query heads this item computes
      scores.assign(rows * len, 0.f);
      for (int64_t p = 0; p < len; ++p) {  // scores: each cached K row once, its heads in turn
        if (p + kAhead < len) prefetch_row(kc + cached(p + kAhead) + h0 * hd, heads * hd);
        const float* key = kc + cached(p) + h0 * hd;
        for (int64_t r = 0; r < rows; ++r)
          scores[r * len + p] = dot(qb + r * hd, key + r / group * hd, hd) * s;
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* sg = scores.data() + r * len;
        const float mx = *std::max_element(sg, sg + len);
        float sum = 0.f;
        for (int64_t p = 0; p < len; ++p) sum += (sg[p] = std::exp(sg[p] - mx));
        const float inv = 1.f / sum;
        for (int64_t p = 0; p < len; ++p) sg[p] *= inv;
      }
      float* ob = op + (b * nh + h0 * group) * hd;
      std::fill(ob, ob + rows * hd, 0.f);
      for (int64_t p = 0; p < len; ++p) {  // outputs: each cached V row once, positions ascending
        if (p + kAhead < len) prefetch_row(vc + cached(p + kAhead) + h0 * hd, heads * hd);
        const float* value = vc + cached(p) + h0 * hd;
        for (int64_t r = 0; r < rows; ++r)
          add_scaled(ob + r * hd, value + r / group * hd, scores[r * len + p], hd);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(prefixserve_cpu, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor token_seq, Tensor token_len, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(prefixserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
