// Decode attention's AVX2 loops (8 lanes, 16 registers): every query head of a work item
// together (float32 queries), or a query head at a time (others, widened). Included by
// decode_attention.h only, inside its namespace, where AVX-512 is missing.
#pragma once
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Lane i of the result is the sum of v[i]'s 8 lanes (three rounds of pairwise adds).
inline __m256 sum_lanes8(const __m256* v) {
  const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// head_scores and head_values with 8 lanes: scores 8 keys at a time, summed by one tree; values
// weighed 64 columns at a time (8 accumulators: AVX2 has 16 registers).
template <int DIM, typename cache_t>
inline void head_scores(const cache_t* keys, const int64_t* slots, int64_t n, int64_t row,
                         const float* qf, float scale, float* scores) {
  __m256 part[8];
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t m = std::min<int64_t>(8, n - j0);
    for (int64_t t = 0; t < 8; ++t) {
      if (t >= m) {
        part[t] = _mm256_setzero_ps();
        continue;
      }
      const cache_t* key = keys + slots[j0 + t] * row;
      __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qf), load8(key));
      __m256 b = _mm256_mul_ps(_mm256_loadu_ps(qf + 8), load8(key + 8));
      for (int c = 16; c < DIM; c += 16) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(qf + c), load8(key + c), a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(qf + c + 8), load8(key + c + 8), b);
      }
      part[t] = _mm256_add_ps(a, b);
    }
    const __m256 s = _mm256_mul_ps(sum_lanes8(part), _mm256_set1_ps(scale));
    if (m == 8) {
      _mm256_storeu_ps(scores + j0, s);
    } else {
      float tmp[8];
      _mm256_storeu_ps(tmp, s);
      std::copy(tmp, tmp + m, scores + j0);
    }
  }
}

template <int DIM, typename cache_t>
inline void head_values(const cache_t* values, const int64_t* slots, int64_t n, int64_t row,
                         const float* probs, float* out) {
  for (int c0 = 0; c0 < DIM; c0 += 64) {
    __m256 acc[8];
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const cache_t* v = values + slots[j] * row + c0;
      const __m256 p = _mm256_set1_ps(probs[j]);
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(p, load8(v + 8 * c), acc[c]);
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(out + c0 + 8 * c, acc[c]);
  }
}

template <typename cache_t>
constexpr bool kHeadRows = std::is_same_v<cache_t, float> ||
                           std::is_same_v<cache_t, c10::BFloat16> || std::is_same_v<cache_t, c10::Half>;

// Every query head of a work item together: the scores of every KV head's group over 8 keys
// while their rows are in L1, then the values over 16 keys the same way. A query head at a time,
// each head read the item's keys and values again (from L2 at best) with two loads an FMA
// (docs/performance.md has the before and after).

// scores[g * stride + t] = scale * <q_g, key t> for G heads (at most 8) and the m <= 8 keys at
// `slots`: every 32 columns of a key are loaded once for the G heads. With few heads a key's sums
// run in several chains (FMA latency over throughput); the 8 keys' lanes are summed by one tree.
template <int DIM, int G, typename cache_t>
inline void group_scores8(const cache_t* keys, const int64_t* slots, int64_t m, int64_t row,
                          const float* q, int64_t q_stride, float scale, float* scores,
                          int64_t stride) {
  constexpr int kChains = G == 1 ? 4 : G <= 3 ? 2 : 1;
  __m256 part[G][8];
  for (int64_t t = 0; t < 8; ++t) {
    if (t >= m) {
      for (int g = 0; g < G; ++g) part[g][t] = _mm256_setzero_ps();
      continue;
    }
    const cache_t* key = keys + slots[t] * row;
    __m256 acc[G][kChains];
    for (int g = 0; g < G; ++g)
      for (int a = 0; a < kChains; ++a) acc[g][a] = _mm256_setzero_ps();
    for (int c0 = 0; c0 < DIM; c0 += 32) {
      __m256 kv[4];
      for (int i = 0; i < 4; ++i) kv[i] = load8(key + c0 + 8 * i);
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 4; ++i) {
          __m256& a = acc[g][(c0 / 8 + i) % kChains];
          a = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * q_stride + c0 + 8 * i), kv[i], a);
        }
    }
    for (int g = 0; g < G; ++g) {
      __m256 sum = acc[g][0];
      for (int a = 1; a < kChains; ++a) sum = _mm256_add_ps(sum, acc[g][a]);
      part[g][t] = sum;
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m256 s = _mm256_mul_ps(sum_lanes8(part[g]), _mm256_set1_ps(scale));
    if (m == 8) {
      _mm256_storeu_ps(scores + g * stride, s);
    } else {
      float tmp[8];
      _mm256_storeu_ps(tmp, s);
      std::copy(tmp, tmp + m, scores + g * stride);
    }
  }
}

// out[g] += sum_j probs[g * stride + j] * value j for G heads (at most 8) over keys [j0, j1):
// each 8W columns of a value row are loaded once for the G heads. W is the widest that keeps the
// G * W sums, the G weights and a value in the 16 registers.
template <int DIM, int G, typename cache_t>
inline void group_values(const cache_t* values, const int64_t* slots, int64_t j0, int64_t j1,
                         int64_t row, const float* probs, int64_t stride, float* out) {
  constexpr int W = G == 1 ? 8 : G <= 3 ? 4 : G <= 5 ? 2 : 1;
  for (int c0 = 0; c0 < DIM; c0 += 8 * W) {
    __m256 acc[G][W];
    for (int g = 0; g < G; ++g)
      for (int w = 0; w < W; ++w) acc[g][w] = _mm256_loadu_ps(out + g * DIM + c0 + 8 * w);
    for (int64_t j = j0; j < j1; ++j) {
      const cache_t* v = values + slots[j] * row + c0;
      __m256 p[G];
      for (int g = 0; g < G; ++g) p[g] = _mm256_broadcast_ss(probs + g * stride + j);
      for (int w = 0; w < W; ++w) {
        const __m256 vv = load8(v + 8 * w);
        for (int g = 0; g < G; ++g) acc[g][w] = _mm256_fmadd_ps(p[g], vv, acc[g][w]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int w = 0; w < W; ++w) _mm256_storeu_ps(out + g * DIM + c0 + 8 * w, acc[g][w]);
  }
}

// Calls f(kvh, h0, std::integral_constant<int, G>) for each pass over a KV head's query heads:
// G (at most 8) of them from head h0.
template <typename F>
inline void for_groups(int64_t kv_heads, int64_t group, F&& f) {
  for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
    for (int64_t g0 = 0; g0 < group; g0 += 8) {
      const int64_t h0 = kvh * group + g0;
      switch (std::min<int64_t>(8, group - g0)) {
        case 1: f(kvh, h0, std::integral_constant<int, 1>{}); break;
        case 2: f(kvh, h0, std::integral_constant<int, 2>{}); break;
        case 3: f(kvh, h0, std::integral_constant<int, 3>{}); break;
        case 4: f(kvh, h0, std::integral_constant<int, 4>{}); break;
        case 5: f(kvh, h0, std::integral_constant<int, 5>{}); break;
        case 6: f(kvh, h0, std::integral_constant<int, 6>{}); break;
        case 7: f(kvh, h0, std::integral_constant<int, 7>{}); break;
        default: f(kvh, h0, std::integral_constant<int, 8>{}); break;
      }
    }
}

// Rows of the keys at slots[begin, end) (every KV head's part) asked into L1: the walk over a
// request's blocks jumps from block to block, where the hardware's prefetchers lose the stream.
template <typename cache_t>
inline void fetch_rows(const cache_t* base, const int64_t* slots, int64_t begin, int64_t end,
                       int64_t row) {
  for (int64_t j = begin; j < end; ++j) {
    const char* p = reinterpret_cast<const char*>(base + slots[j] * row);
    for (int64_t o = 0; o < row * static_cast<int64_t>(sizeof(cache_t)); o += 64)
      __builtin_prefetch(p + o, 0, 3);
  }
}

template <int DIM, typename cache_t>
inline void attend_groups(const cache_t* keys, const cache_t* values, const int64_t* slots,
                          int64_t n, int64_t row, int64_t kv_heads, const float* q,
                          int64_t q_stride, int64_t group, float scale, float cap, float* scores,
                          float* out, float* peak, float* total) {
  const int64_t heads = kv_heads * group;
  fetch_rows(keys, slots, 0, std::min<int64_t>(n, kPrefetchKeys), row);
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    fetch_rows(keys, slots, std::min(n, j0 + kPrefetchKeys), std::min(n, j0 + 8 + kPrefetchKeys),
               row);
    const int64_t m = std::min<int64_t>(8, n - j0);
    for_groups(kv_heads, group, [&](int64_t kvh, int64_t h0, auto g) {
      group_scores8<DIM, decltype(g)::value>(keys + kvh * DIM, slots + j0, m, row,
                                             q + h0 * q_stride, q_stride, scale,
                                             scores + h0 * n + j0, n);
    });
  }
  fetch_rows(values, slots, 0, std::min<int64_t>(n, kPrefetchKeys), row);
  for (int64_t h = 0; h < heads; ++h) exp_scores(scores + h * n, n, cap, &peak[h], &total[h]);
  // The values 16 keys at a time: each pass's sums go back to `out` after a block.
  std::fill(out, out + heads * DIM, 0.f);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    fetch_rows(values, slots, std::min(n, j0 + kPrefetchKeys),
               std::min(n, j0 + 16 + kPrefetchKeys), row);
    const int64_t j1 = std::min(n, j0 + 16);
    for_groups(kv_heads, group, [&](int64_t kvh, int64_t h0, auto g) {
      group_values<DIM, decltype(g)::value>(values + kvh * DIM, slots, j0, j1, row,
                                            scores + h0 * n, n, out + h0 * DIM);
    });
  }
}

// Every query head of a work item over the keys at `slots[0..n)` (decode_attention.h states the
// contract) with float32 queries; false where this path does not apply (another query dtype or
// head size).
template <typename q_t, typename cache_t>
inline bool attend_kv_heads(const cache_t* keys, const cache_t* values, const int64_t* slots,
                            int64_t n, int64_t row, int64_t dim, int64_t kv_heads, const q_t* q,
                            int64_t q_stride, int64_t group, float scale, float cap,
                            float* scores, float* out, float* peak, float* total, KvPrefetch*,
                            bool) {
  if constexpr (!std::is_same_v<q_t, float> || !kHeadRows<cache_t>) {
    return false;
  } else {
    switch (dim) {
      case 64:
        attend_groups<64>(keys, values, slots, n, row, kv_heads, q, q_stride, group, scale, cap,
                          scores, out, peak, total);
        return true;
      case 128:
        attend_groups<128>(keys, values, slots, n, row, kv_heads, q, q_stride, group, scale, cap,
                           scores, out, peak, total);
        return true;
      case 256:
        attend_groups<256>(keys, values, slots, n, row, kv_heads, q, q_stride, group, scale, cap,
                           scores, out, peak, total);
        return true;
      default:
        return false;
    }
  }
}
