// Decode attention over the paged KV cache, one query token at a time: per-head scores
// and weighted values, prefetching of the next item's K and V rows, the bf16 dot-product path.
// Included by cpu_ops.cpp only (the kernels' translation unit), so calls between these files
// inline.
#pragma once

#include "simd.h"

namespace {

// One head's scores [n] -> their exps against the peak (after the softcap, when cap > 0), left
// unnormalized: *peak and *total let key ranges computed apart be merged.
inline void exp_scores(float* scores, int64_t n, float cap, float* peak, float* total) {
  if (cap > 0.f)
    for (int64_t j = 0; j < n; ++j) scores[j] = std::tanh(scores[j] / cap) * cap;
  *peak = peak_of(scores, n);
  *total = exp_shifted(scores, n, *peak);
}

// dots[g] = <q_g, key> for the `group` query heads sharing this KV head.
template <typename cache_t>
inline void dot_queries(const cache_t* key, const float* qf, int64_t group, int64_t dim,
                        float* scratch, float* dots) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<cache_t, double>) if (dim % 16 == 0) {
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * dim;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), load16(key));
      for (int64_t d = 16; d < dim; d += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), load16(key + d), acc);
      dots[g] = _mm512_reduce_add_ps(acc);
    }
    return;
  }
#endif
  widen(key, scratch, dim);
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = qf + g * dim;
    float dot = 0.f;
    for (int64_t d = 0; d < dim; ++d) dot += qg[d] * scratch[d];
    dots[g] = dot;
  }
}

// acc_g += probs[g] * value for each query head g.
template <typename cache_t>
inline void add_scaled(const cache_t* value, const float* probs, int64_t group, int64_t dim,
                       float* scratch, float* acc) {
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<cache_t, double>) if (dim % 16 == 0) {
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512 v = load16(value + d);
      for (int64_t g = 0; g < group; ++g) {
        float* a = acc + g * dim + d;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(probs[g]), v, _mm512_loadu_ps(a)));
      }
    }
    return;
  }
#endif
  widen(value, scratch, dim);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += probs[g] * scratch[d];
}

// Prefetches for decode attention, whose keys lie in blocks anywhere in the cache. Loaded on
// demand, a batch's attention ran at a third of DRAM's bandwidth: the first pass over a
// request's keys waited on memory with little to compute, and the later passes (the other heads,
// the values) computed from cache with nothing in flight. So while one work item computes,
// burst() brings the next item's K and V rows into L2 a line of each per key visited; the first
// pass over a thread's first item fetches its rows kPrefetchKeys ahead.
struct KvPrefetch {
  const char* keys;
  const char* values;
  int64_t row_bytes;  // one slot's row: every KV head
  const int64_t* next = nullptr;  // the next item's slots
  int64_t next_n = 0, idx = 0, off = 0;
  const char* k_row = nullptr;
  const char* v_row = nullptr;

  void start(const int64_t* slots, int64_t n) {
    next = slots;
    next_n = n;
    idx = 0;
    off = row_bytes;
  }
  // A line of K and one of V per key visited, issued 16 at a time (a check per key costs
  // as much as a key's dot products in the scores passes).
  __attribute__((always_inline)) void burst() {
    if (idx == next_n && off >= row_bytes) return;
    for (int i = 0; i < 16; ++i) {
      if (off >= row_bytes) {
        if (idx == next_n) return;
        k_row = keys + next[idx] * row_bytes;
        v_row = values + next[idx] * row_bytes;
        ++idx;
        off = 0;
      }
      __builtin_prefetch(k_row + off, 0, 2);
      __builtin_prefetch(v_row + off, 0, 2);
      off += 64;
    }
  }
  __attribute__((always_inline)) void fetch_row(int64_t slot) const {
    for (int64_t o = 0; o < row_bytes; o += 64) {
      __builtin_prefetch(keys + slot * row_bytes + o, 0, 3);
      __builtin_prefetch(values + slot * row_bytes + o, 0, 2);  // used after a head's scores
    }
  }
};
constexpr int64_t kPrefetchKeys = 24;
// A thread's first item asks for all of its K and V rows at once where they fit this easily in
// L2 (a batch-1 decode's half context: 384 B a token a layer for SmolLM2, K and V). The first
// pass still fetches kPrefetchKeys ahead: that much does not fit L1, and those prefetches bring
// the rows back from L2 just before use (without them the burst measured slower). Fetched only
// kPrefetchKeys ahead, with the rows cold (a decode step's 96 MB of weights had streamed through
// the cache since), 30 layers took 30-37 us a layer at 192 tokens of context and 50-63 us at
// 448; all at once, 21-28 and 39-48 us (AMD EPYC, 2 threads).
constexpr int64_t kBurstBytes = 256 * 1024;

#if defined(__AVX512F__)
// Lane i of the result is the sum of v[i]'s 16 lanes: a transpose-and-add tree, about 3
// instructions per vector where a reduction per vector costs 8 on one dependency chain.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's partial sums of 4 vectors
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
  const __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                  _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                  _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x88), _mm512_shuffle_f32x4(lo, hi, 0xDD));
}

// scores[j] = scale * (the lanes of key_dot(j) summed) for j < n: 16 keys' partial products are
// summed together by one transpose-and-add tree.
template <typename KeyDot>
inline void scores_by16(int64_t n, float scale, float* scores, KeyDot&& key_dot) {
  __m512 part[16];
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    for (int64_t t = 0; t < 16; ++t) part[t] = t < m ? key_dot(j0 + t) : _mm512_setzero_ps();
    const __m512 s = _mm512_mul_ps(sum_lanes16(part), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(scores + j0, static_cast<__mmask16>((1u << m) - 1), s);
  }
}

// scores[j] = scale * <q, key j> for one query head: q stays in registers, keys stream by.
template <int DIM, typename cache_t>
inline void head_scores(const cache_t* keys, const int64_t* slots, int64_t n, int64_t row,
                        const float* qf, float scale, float* scores) {
  __m512 q[DIM / 16];
  for (int c = 0; c < DIM / 16; ++c) q[c] = _mm512_loadu_ps(qf + 16 * c);
  scores_by16(n, scale, scores, [&](int64_t j) {
    const cache_t* key = keys + slots[j] * row;
    __m512 acc = _mm512_mul_ps(q[0], load16(key));
    for (int c = 1; c < DIM / 16; ++c) acc = _mm512_fmadd_ps(q[c], load16(key + 16 * c), acc);
    return acc;
  });
}

// out = sum_j probs[j] * value j for one query head, accumulated in registers (two sets, so
// consecutive keys do not wait on each other's adds).
template <int DIM, typename cache_t>
inline void head_values(const cache_t* values, const int64_t* slots, int64_t n, int64_t row,
                        const float* probs, float* out) {
  __m512 even[DIM / 16], odd[DIM / 16];
  for (int c = 0; c < DIM / 16; ++c) even[c] = odd[c] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    const cache_t* v0 = values + slots[j] * row;
    const cache_t* v1 = values + slots[j + 1] * row;
    const __m512 p0 = _mm512_set1_ps(probs[j]), p1 = _mm512_set1_ps(probs[j + 1]);
    for (int c = 0; c < DIM / 16; ++c) {
      even[c] = _mm512_fmadd_ps(p0, load16(v0 + 16 * c), even[c]);
      odd[c] = _mm512_fmadd_ps(p1, load16(v1 + 16 * c), odd[c]);
    }
  }
  if (j < n) {
    const cache_t* v0 = values + slots[j] * row;
    const __m512 p0 = _mm512_set1_ps(probs[j]);
    for (int c = 0; c < DIM / 16; ++c) even[c] = _mm512_fmadd_ps(p0, load16(v0 + 16 * c), even[c]);
  }
  for (int c = 0; c < DIM / 16; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_add_ps(even[c], odd[c]));
}

#if defined(__AVX512BF16__)
// scores[j] = scale * <q, key j> with q and the keys in bf16: vdpbf16ps multiplies bf16 pairs
// exactly and sums them in float32, so neither side is widened (a fifth of the instructions of
// the float32 loop above). q is a bf16 tensor's row already, so the scores are the same sums.
// `ahead`: this is the first pass over the item's keys (see KvPrefetch).
template <int DIM>
inline void head_scores_bf16(const c10::BFloat16* keys, const int64_t* slots, int64_t n,
                             int64_t row, const c10::BFloat16* q, float scale, float* scores,
                             KvPrefetch* pf, bool ahead) {
  __m512bh qv[DIM / 32];
  for (int c = 0; c < DIM / 32; ++c)
    qv[c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(q + 32 * c));
  if (ahead)
    for (int64_t j = 0; j < std::min<int64_t>(n, kPrefetchKeys); ++j) pf->fetch_row(slots[j]);
  // 16 keys at a time, the prefetches between them (kept out of the unrolled loop, whose 16
  // partial sums fill the registers).
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    if (ahead)
      for (int64_t j = j0 + kPrefetchKeys; j < std::min(n, j0 + 16 + kPrefetchKeys); ++j)
        pf->fetch_row(slots[j]);
    if (pf != nullptr) pf->burst();
    scores_by16(std::min<int64_t>(16, n - j0), scale, scores + j0, [&](int64_t j) {
      const c10::BFloat16* key = keys + slots[j0 + j] * row;
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < DIM / 32; ++c)
        acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(
                                               reinterpret_cast<const void*>(key + 32 * c)));
      return acc;
    });
  }
}
#endif

// out[g] = sum_j probs[g][j] * value j for G query heads sharing one KV head: each value row is
// widened once for all of them.
template <int DIM, int G, typename cache_t>
inline void group_values(const cache_t* values, const int64_t* slots, int64_t n, int64_t row,
                         const float* probs, int64_t probs_stride, float* out, KvPrefetch* pf) {
  __m512 acc[G][DIM / 16];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DIM / 16; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if ((j & 15) == 0 && pf != nullptr) pf->burst();
    const cache_t* v = values + slots[j] * row;
    __m512 vv[DIM / 16];
    for (int c = 0; c < DIM / 16; ++c) vv[c] = load16(v + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g * probs_stride + j]);
      for (int c = 0; c < DIM / 16; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DIM / 16; ++c) _mm512_storeu_ps(out + g * DIM + 16 * c, acc[g][c]);
}

// Up to 16 accumulators: 4 heads of 64, 2 of 128, 1 of 256 per pass over the values.
template <int DIM, typename cache_t>
inline void heads_values(const cache_t* values, const int64_t* slots, int64_t n, int64_t row,
                         const float* probs, int64_t probs_stride, int64_t heads, float* out,
                         KvPrefetch* pf) {
  constexpr int kAtOnce = 256 / DIM;
  for (int64_t h = 0; h < heads; h += kAtOnce) {
    const float* p = probs + h * probs_stride;
    float* o = out + h * DIM;
    // (kAtOnce >= G ? G : 1): only the counts that fit this head size are instantiated.
    switch (std::min<int64_t>(kAtOnce, heads - h)) {
      case 1:
        group_values<DIM, 1>(values, slots, n, row, p, probs_stride, o, pf);
        break;
      case 2:
        group_values<DIM, (kAtOnce >= 2 ? 2 : 1)>(values, slots, n, row, p, probs_stride, o, pf);
        break;
      case 3:
        group_values<DIM, (kAtOnce >= 3 ? 3 : 1)>(values, slots, n, row, p, probs_stride, o, pf);
        break;
      default:
        group_values<DIM, (kAtOnce >= 4 ? 4 : 1)>(values, slots, n, row, p, probs_stride, o, pf);
        break;
    }
  }
}

// The query heads of one KV head over the keys at `slots[0..n)`, n >= 1, all in bf16: scores
// by bf16 dot products, exps against each head's peak, and the values weighed by them (read once
// for the group), left unnormalized as attend_head leaves them.
#if defined(__AVX512BF16__)
inline void attend_kv_head_bf16(const c10::BFloat16* keys, const c10::BFloat16* values,
                                const int64_t* slots, int64_t n, int64_t row, int64_t dim,
                                const c10::BFloat16* q, int64_t q_stride, int64_t group,
                                float scale, float cap, float* scores, float* out, float* peak,
                                float* total, KvPrefetch* pf, bool first) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * n;
    const c10::BFloat16* qg = q + g * q_stride;
    const bool ahead = first && g == 0;
    switch (dim) {
      case 64: head_scores_bf16<64>(keys, slots, n, row, qg, scale, sg, pf, ahead); break;
      case 128: head_scores_bf16<128>(keys, slots, n, row, qg, scale, sg, pf, ahead); break;
      default: head_scores_bf16<256>(keys, slots, n, row, qg, scale, sg, pf, ahead); break;
    }
    exp_scores(sg, n, cap, &peak[g], &total[g]);
  }
  switch (dim) {
    case 64: heads_values<64>(values, slots, n, row, scores, n, group, out, pf); break;
    case 128: heads_values<128>(values, slots, n, row, scores, n, group, out, pf); break;
    default: heads_values<256>(values, slots, n, row, scores, n, group, out, pf); break;
  }
}
#endif

// Every query head of a work item over the keys at `slots[0..n)`, n >= 1 (q: its first head,
// heads q_stride apart; `group` query heads a KV head): scores, exps against each head's peak and
// the values weighed, unnormalized (out [heads, dim], peak and total [heads]). Here the bf16
// path, a KV head at a time; false where it does not apply (no AVX-512-BF16, another dtype or
// head size).
template <typename q_t, typename cache_t>
inline bool attend_kv_heads(const cache_t* keys, const cache_t* values, const int64_t* slots,
                            int64_t n, int64_t row, int64_t dim, int64_t kv_heads, const q_t* q,
                            int64_t q_stride, int64_t group, float scale, float cap,
                            float* scores, float* out, float* peak, float* total,
                            KvPrefetch* pf, bool first) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<q_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
    if (dim != 64 && dim != 128 && dim != 256) return false;
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      const int64_t h0 = kvh * group;
      attend_kv_head_bf16(keys + kvh * dim, values + kvh * dim, slots, n, row, dim,
                          q + h0 * q_stride, q_stride, group, scale, cap, scores + h0 * n,
                          out + h0 * dim, peak + h0, total + h0, pf, kvh == 0 && first);
    }
    return true;
  }
#endif
  return false;
}

// The cache dtypes whose rows head_scores / head_values read (load16 or load8).
template <typename cache_t>
constexpr bool kHeadRows = !std::is_same_v<cache_t, double>;
#elif defined(__AVX2__) && defined(__FMA__)
#include "decode_attention_avx2.h"
#else
template <typename cache_t>
inline bool attend_head(const cache_t*, const cache_t*, const int64_t*, int64_t, int64_t, int64_t,
                        const float*, float, float, float*, float*, float*, float*) {
  return false;
}
template <typename q_t, typename cache_t>
inline bool attend_kv_heads(const cache_t*, const cache_t*, const int64_t*, int64_t, int64_t,
                            int64_t, int64_t, const q_t*, int64_t, int64_t, float, float, float*,
                            float*, float*, float*, KvPrefetch*, bool) {
  return false;
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// One query head over the keys at `slots[0..n)`, n >= 1: scores, their exps against the peak
// score, and the values those weigh, left unnormalized (out, *peak, *total) so that key ranges
// of one context computed apart can be merged. Returns false when the head size has no
// specialization here (the caller then takes the generic loops).
template <typename cache_t>
inline bool attend_head(const cache_t* keys, const cache_t* values, const int64_t* slots,
                        int64_t n, int64_t row, int64_t dim, const float* qf, float scale,
                        float cap, float* scores, float* out, float* peak, float* total) {
  if constexpr (!kHeadRows<cache_t>) {
    return false;
  } else {
    switch (dim) {
      case 64: head_scores<64>(keys, slots, n, row, qf, scale, scores); break;
      case 128: head_scores<128>(keys, slots, n, row, qf, scale, scores); break;
      case 256: head_scores<256>(keys, slots, n, row, qf, scale, scores); break;
      default: return false;
    }
    exp_scores(scores, n, cap, peak, total);
    switch (dim) {
      case 64: head_values<64>(values, slots, n, row, scores, out); break;
      case 128: head_values<128>(values, slots, n, row, scores, out); break;
      default: head_values<256>(values, slots, n, row, scores, out); break;
    }
    return true;
  }
}
#endif

}  // namespace
