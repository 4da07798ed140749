// Fused CPU kernels for the decode hot path. Each one replaces a chain of small ATen calls whose
// dispatch cost, not arithmetic, dominates a decode step of a small model. Every kernel has a
// pure-PyTorch twin in octavo/kernels/fused.py that the tests compare it with.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

// A row of the cache widened to float32; bf16 widening is a shift, which the compiler
// vectorizes where c10::BFloat16's conversion operator is not.
template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void widen<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(raw[i]) << 16;
}

// K and V of one step go to their cache slots: cache [num_blocks, block_size, kv_heads, head_dim]
// viewed as rows of kv_heads * head_dim, one row per slot.
template <typename src_t, typename cache_t>
void write_rows(const torch::Tensor& src, torch::Tensor& cache, const int64_t* slots, int64_t n) {
  const int64_t width = cache.size(2) * cache.size(3);
  const int64_t heads = src.size(1), dim = src.size(2);
  const int64_t s0 = src.stride(0), s1 = src.stride(1), s2 = src.stride(2);
  const src_t* in = src.data_ptr<src_t>();
  cache_t* out = cache.data_ptr<cache_t>();
  for (int64_t t = 0; t < n; ++t) {
    cache_t* row = out + slots[t] * width;
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < dim; ++d)
        row[h * dim + d] = static_cast<cache_t>(to_f(in[t * s0 + h * s1 + d * s2]));
  }
}

template <typename cache_t>
void write_kv_typed(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& kc,
                    torch::Tensor& vc, const int64_t* slots, int64_t n) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    write_rows<scalar_t, cache_t>(k, kc, slots, n);
    write_rows<scalar_t, cache_t>(v, vc, slots, n);
  });
}

constexpr int64_t kMaxGroup = 64;  // query heads per KV head

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// fp8 e4m3fn (the fp8 KV cache): exponent and mantissa moved under float32's (bits 20-26) read
// as a float are the value times 2^-120, subnormals included; the sign bit goes to bit 31.
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(raw, _mm512_set1_epi32(0x7F)), 20);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(raw, _mm512_set1_epi32(0x80)), 24);
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(mag, sign)),
                       _mm512_set1_ps(1.329228e36f));  // 2^120
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// float32 to bfloat16, rounded to nearest even, as the bits' upper halves (finite values).
inline __m512i bf16_round_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_and_si512(_mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)),
                          _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
}

// v rounded to T and widened back: what static_cast<T> then to_f do, for 16 lanes.
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) return _mm512_castsi512_ps(bf16_round_bits(v));
  else return v;
}

template <typename T>
inline void store16(T* p, __m512 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round_bits(v), 16)));
  } else {
    _mm512_storeu_ps(p, v);
  }
}

// Whether the 16-lane row routines below take T (float and bf16 rows with 16 | width).
template <typename T>
constexpr bool kVec16 = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// exp of 16 floats: 2^k * p(r) with x = k ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor
// polynomial (relative error about 2e-7, below bf16 and close to float rounding).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // below this exp is 0 in float anyway
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693147180559945309f), x);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, k);
}

// tanh of 16 floats as 1 - 2 / (exp(2x) + 1): std::tanh's value up to float rounding, in
// absolute terms (what a softcap's scores need).
inline __m512 tanh16(__m512 x) {
  const __m512 e = exp16(_mm512_add_ps(x, x));
  return _mm512_sub_ps(_mm512_set1_ps(1.f),
                       _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, _mm512_set1_ps(1.f))));
}

// x[i] = exp(x[i] - shift); returns the sum.
inline float exp_shifted(float* x, int64_t n, float shift) {
  float total = 0.f;
  int64_t i = 0;
  const __m512 m = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), m));
    _mm512_storeu_ps(x + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + i), m));
    _mm512_mask_storeu_ps(x + i, tail, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
  }
  total = _mm512_reduce_add_ps(sum);
  return total;
}

// The largest of x[0..n), n >= 1. std::max_element compiles to one scalar max a score, each
// waiting on the last (4 cycles): 21% of batch-1 decode attention's samples.
inline float peak_of(const float* x, int64_t n) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top2 = top;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    top = _mm512_max_ps(top, _mm512_loadu_ps(x + i));
    top2 = _mm512_max_ps(top2, _mm512_loadu_ps(x + i + 16));
  }
  for (; i + 16 <= n; i += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(x + i));
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, x + i));
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(top, top2));
}
#elif defined(__AVX2__) && defined(__FMA__)
// The 8-lane versions of the routines above, for CPUs with AVX2 but not AVX-512 (AMD Zen 3 and
// older, Intel client cores).

inline float sum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 d = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

inline float max8(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 d = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(d, _mm_movehdup_ps(d)));
}

// exp of 8 floats as exp16 computes it; 2^k goes into the exponent bits, so below x = -87.3
// (where float's normal range ends) the result is 0, and above 88 it stays exp(88).
inline __m256 exp8(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693147180559945309f), x);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i two_k = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(two_k)));
}

inline float exp_shifted(float* x, int64_t n, float shift) {
  const __m256 m = _mm256_set1_ps(shift);
  __m256 sum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
    _mm256_storeu_ps(x + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = sum8(sum);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    total += x[i];
  }
  return total;
}

inline float peak_of(const float* x, int64_t n) {
  __m256 top = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 top2 = top;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    top = _mm256_max_ps(top, _mm256_loadu_ps(x + i));
    top2 = _mm256_max_ps(top2, _mm256_loadu_ps(x + i + 8));
  }
  float best = max8(_mm256_max_ps(top, top2));
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
}
#else
inline float peak_of(const float* x, int64_t n) { return *std::max_element(x, x + n); }

inline float exp_shifted(float* x, int64_t n, float shift) {
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    total += x[i];
  }
  return total;
}
#endif

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
// for the group), left unnormalized as attend_head leaves them. Returns false where this path
// does not apply (no AVX-512-BF16, another dtype or head size).
template <typename q_t, typename cache_t>
inline bool attend_kv_head(const cache_t* keys, const cache_t* values, const int64_t* slots,
                           int64_t n, int64_t row, int64_t dim, const q_t* q, int64_t q_stride,
                           int64_t group, float scale, float cap, float* scores, float* out,
                           float* peak, float* total, KvPrefetch* pf, bool first) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<q_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
    if (dim != 64 && dim != 128 && dim != 256) return false;
    for (int64_t g = 0; g < group; ++g) {
      float* sg = scores + g * n;
      const c10::BFloat16* qg = q + g * q_stride;
      const bool ahead = first && g == 0;
      switch (dim) {
        case 64: head_scores_bf16<64>(keys, slots, n, row, qg, scale, sg, pf, ahead); break;
        case 128: head_scores_bf16<128>(keys, slots, n, row, qg, scale, sg, pf, ahead); break;
        default: head_scores_bf16<256>(keys, slots, n, row, qg, scale, sg, pf, ahead); break;
      }
      if (cap > 0.f)
        for (int64_t j = 0; j < n; ++j) sg[j] = std::tanh(sg[j] / cap) * cap;
      peak[g] = peak_of(sg, n);
      total[g] = exp_shifted(sg, n, peak[g]);
    }
    switch (dim) {
      case 64: heads_values<64>(values, slots, n, row, scores, n, group, out, pf); break;
      case 128: heads_values<128>(values, slots, n, row, scores, n, group, out, pf); break;
      default: heads_values<256>(values, slots, n, row, scores, n, group, out, pf); break;
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
template <typename q_t, typename cache_t>
inline bool attend_kv_head(const cache_t*, const cache_t*, const int64_t*, int64_t, int64_t,
                           int64_t, const q_t*, int64_t, int64_t, float, float, float*, float*,
                           float*, float*, KvPrefetch*, bool) {
  return false;
}
#else
template <typename cache_t>
inline bool attend_head(const cache_t*, const cache_t*, const int64_t*, int64_t, int64_t, int64_t,
                        const float*, float, float, float*, float*, float*, float*) {
  return false;
}
template <typename q_t, typename cache_t>
inline bool attend_kv_head(const cache_t*, const cache_t*, const int64_t*, int64_t, int64_t,
                           int64_t, const q_t*, int64_t, int64_t, float, float, float*, float*,
                           float*, float*, KvPrefetch*, bool) {
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
    if (cap > 0.f)
      for (int64_t j = 0; j < n; ++j) scores[j] = std::tanh(scores[j] / cap) * cap;
    *peak = peak_of(scores, n);
    *total = exp_shifted(scores, n, *peak);
    switch (dim) {
      case 64: head_values<64>(values, slots, n, row, scores, out); break;
      case 128: head_values<128>(values, slots, n, row, scores, out); break;
      default: head_values<256>(values, slots, n, row, scores, out); break;
    }
    return true;
  }
}
#endif

// Prompt tokens of one request, up to 16 at a time: lane i of every vector is query i, so each key
// and value row is read once for 16 queries where the per-query path reads it once per query.
// Scores come from vdpbf16ps against the queries' bf16 pairs (exact products summed in float32,
// like the per-query path); the softmax is online (a running peak per query, the sums rescaled
// when it rises), and the values are weighed in float32. Causal: query i (context position
// first_pos + i) sees the keys at positions <= its own, and with a window the latest `window`
// of them.
struct QueryRun {
  int64_t entry;  // the run's first entry of token_index / block_table / seq_lens
  int64_t count;  // its query tokens: consecutive positions over the same blocks
};
constexpr int64_t kRunLanes = 16;
// Runs shorter than this stay with the per-query path, which splits one request's keys between
// threads (a decode, a speculative verification).
constexpr int64_t kMinRun = 16;

#if defined(__AVX512BF16__)
struct PrefillScratch {
  std::vector<uint32_t> qt;  // [group][dim / 2][16]: query i's bf16 pair p at [p][i]
  std::vector<float> o;      // [group][dim][16] weighted sums of values, unnormalized
  std::vector<float> peak, total;  // [group][16]
  std::vector<c10::BFloat16> kt;   // [16][dim] the tile's keys
  std::vector<float> vf;           // [16][dim] the tile's values in float32
  alignas(64) float p[kRunLanes][kRunLanes];  // [key][query] the tile's softmax weights
};

template <int DIM>
void prefill_block(const c10::BFloat16* keys, const c10::BFloat16* values, int64_t row,
                   const int64_t* table, int64_t block_size, const c10::BFloat16* q,
                   int64_t qs0, int64_t qs1, int64_t nq, int64_t first_pos, int64_t group,
                   float scale, float cap, int64_t window, c10::BFloat16* out, int64_t os0,
                   int64_t os1, PrefillScratch& s) {
  constexpr int64_t kPairs = DIM / 2;
  s.qt.assign(group * kPairs * kRunLanes, 0u);  // padding lanes: zero queries
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < nq; ++i) {
      const uint32_t* src = reinterpret_cast<const uint32_t*>(q + i * qs0 + g * qs1);
      for (int64_t p = 0; p < kPairs; ++p) s.qt[(g * kPairs + p) * kRunLanes + i] = src[p];
    }
  s.o.assign(group * DIM * kRunLanes, 0.f);
  // A finite floor for the running peaks: a query that sees no key of a tile (a window's
  // first tile) keeps a rescale of 1 and sums of 0 instead of inf - inf.
  s.peak.assign(group * kRunLanes, -1e30f);
  s.total.assign(group * kRunLanes, 0.f);
  s.kt.resize(kRunLanes * DIM);
  s.vf.resize(kRunLanes * DIM);
  const int64_t last_pos = first_pos + nq - 1;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // Padding lanes repeat the last query's position: finite scores, never written out.
  const __m512i qpos = _mm512_min_epi32(
      _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first_pos)), lane),
      _mm512_set1_epi32(static_cast<int>(last_pos)));
  const __m512 vscale = _mm512_set1_ps(scale), vcap = _mm512_set1_ps(cap);
  const __m512 inv_cap = _mm512_set1_ps(cap > 0.f ? 1.f / cap : 0.f);
  const __m512i horizon = _mm512_sub_epi32(qpos, _mm512_set1_epi32(static_cast<int>(window)));
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  for (int64_t k0 = first_key / kRunLanes * kRunLanes; k0 <= last_pos; k0 += kRunLanes) {
    // The tile's rows, copied so that one register addresses them all; keys past the last
    // query (a partial tile) repeat its row and are masked out below.
    __mmask16 seen[kRunLanes];
    for (int64_t j = 0; j < kRunLanes; ++j) {
      const int64_t pos = std::min(k0 + j, last_pos);
      const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
      std::memcpy(s.kt.data() + j * DIM, keys + slot * row, DIM * sizeof(c10::BFloat16));
      for (int64_t d = 0; d < DIM; d += 16)
        _mm512_storeu_ps(s.vf.data() + j * DIM + d, load16(values + slot * row + d));
      const __m512i kpos = _mm512_set1_epi32(static_cast<int>(k0 + j));
      seen[j] = _mm512_cmpge_epi32_mask(qpos, kpos);
      if (window > 0) seen[j] &= _mm512_cmpgt_epi32_mask(kpos, horizon);
    }
    const int32_t* kt = reinterpret_cast<const int32_t*>(s.kt.data());
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc[kRunLanes];
      for (int j = 0; j < kRunLanes; ++j) acc[j] = _mm512_setzero_ps();
      const uint32_t* qg = s.qt.data() + g * kPairs * kRunLanes;
      for (int64_t p0 = 0; p0 < kPairs; p0 += 8) {
        __m512i qr[8];
        for (int u = 0; u < 8; ++u)
          qr[u] = _mm512_loadu_si512(qg + (p0 + u) * kRunLanes);
        for (int u = 0; u < 8; ++u)
          for (int j = 0; j < kRunLanes; ++j)
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)qr[u],
                                      (__m512bh)_mm512_set1_epi32(kt[j * kPairs + p0 + u]));
      }
      float* peak = s.peak.data() + g * kRunLanes;
      float* total = s.total.data() + g * kRunLanes;
      const __m512 old_peak = _mm512_loadu_ps(peak);
      __m512 top = old_peak;
      for (int j = 0; j < kRunLanes; ++j) {
        acc[j] = _mm512_mul_ps(acc[j], vscale);
        if (cap > 0.f) acc[j] = _mm512_mul_ps(tanh16(_mm512_mul_ps(acc[j], inv_cap)), vcap);
        top = _mm512_mask_max_ps(top, seen[j], top, acc[j]);
      }
      const __m512 rescale = exp16(_mm512_sub_ps(old_peak, top));
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < kRunLanes; ++j) {
        const __m512 w = _mm512_maskz_mov_ps(seen[j], exp16(_mm512_sub_ps(acc[j], top)));
        _mm512_store_ps(s.p[j], w);
        sum = _mm512_add_ps(sum, w);
      }
      _mm512_storeu_ps(peak, top);
      _mm512_storeu_ps(total, _mm512_fmadd_ps(_mm512_loadu_ps(total), rescale, sum));
      float* og = s.o.data() + g * DIM * kRunLanes;
      for (int64_t d0 = 0; d0 < DIM; d0 += 16) {
        __m512 o[16];
        for (int d = 0; d < 16; ++d)
          o[d] = _mm512_mul_ps(_mm512_loadu_ps(og + (d0 + d) * kRunLanes), rescale);
        for (int j = 0; j < kRunLanes; ++j) {
          const __m512 w = _mm512_load_ps(s.p[j]);
          const float* v = s.vf.data() + j * DIM + d0;
          for (int d = 0; d < 16; ++d) o[d] = _mm512_fmadd_ps(w, _mm512_set1_ps(v[d]), o[d]);
        }
        for (int d = 0; d < 16; ++d) _mm512_storeu_ps(og + (d0 + d) * kRunLanes, o[d]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float* og = s.o.data() + g * DIM * kRunLanes;
    const float* total = s.total.data() + g * kRunLanes;
    for (int64_t i = 0; i < nq; ++i) {
      c10::BFloat16* dst = out + i * os0 + g * os1;
      const float inv = 1.f / total[i];
      for (int64_t d = 0; d < DIM; ++d)
        dst[d] = static_cast<c10::BFloat16>(og[d * kRunLanes + i] * inv);
    }
  }
}
#endif

// Whether prompt runs take prefill_block: bf16 queries and cache, a head size it is built for.
template <typename q_t, typename cache_t>
bool runs_supported(int64_t dim) {
#if defined(__AVX512BF16__)
  return std::is_same_v<q_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16> &&
         (dim == 64 || dim == 128 || dim == 256);
#else
  return false;
#endif
}

// Splits the entries (one per query token) into runs of at least kMinRun tokens at consecutive
// positions that see the same blocks, and the single entries left. Entry e joins the run begun
// at `first` when its token follows e - 1's, its context is one longer, and its table matches
// the run's first entry's through the block of its own position: then the run's queries see
// exactly the keys they would each see alone (requests that share cached blocks included).
void split_runs(int64_t entries, const int64_t* tok, const int64_t* lens, const int64_t* tables,
                int64_t bt_stride, int64_t block_size, std::vector<QueryRun>& runs,
                std::vector<int64_t>& single) {
  auto flush = [&](int64_t first, int64_t n) {
    if (n >= kMinRun) {
      runs.push_back({first, n});
    } else {
      for (int64_t e = first; e < first + n; ++e) single.push_back(e);
    }
  };
  int64_t first = 0;
  for (int64_t e = 1; e <= entries; ++e) {
    const bool joins =
        e < entries && tok[e] == tok[e - 1] + 1 && lens[e] == lens[e - 1] + 1 &&
        std::memcmp(tables + e * bt_stride, tables + first * bt_stride,
                    ((lens[e] - 1) / block_size + 1) * sizeof(int64_t)) == 0;
    if (!joins) {
      flush(first, e - first);
      first = e;
    }
  }
}

#if defined(__AVX512BF16__)
// The runs' blocks of 16 queries times KV heads are the work items, longest context first, taken
// by whichever thread is free: a prompt's later blocks read more keys, and the per-query path,
// which hands each thread a contiguous half of the tokens, left one thread the longer half (a
// 440-token prompt: 2.3-2.9 ms a layer there, 1.5 here, on 2 threads; alike on one).
void prefill_runs(const std::vector<QueryRun>& runs, const c10::BFloat16* qp, int64_t qs0,
                  int64_t qs1, c10::BFloat16* op, int64_t os0, int64_t os1,
                  const c10::BFloat16* kp, const c10::BFloat16* vp, int64_t row, int64_t dim,
                  int64_t kv_heads, int64_t group, const int64_t* tok, const int64_t* lens,
                  const int64_t* tables, int64_t bt_stride, int64_t block_size, float scale,
                  float cap, int64_t window) {
  struct Item {
    int64_t entry, nq, kvh;
  };
  std::vector<Item> items;
  for (const QueryRun& run : runs)
    for (int64_t b = 0; b < run.count; b += kRunLanes)
      for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
        items.push_back({run.entry + b, std::min(kRunLanes, run.count - b), kvh});
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return lens[a.entry + a.nq - 1] > lens[b.entry + b.nq - 1];
  });
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(items.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    PrefillScratch s;
    for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
      const Item& it = items[i];
      const int64_t e = it.entry, h0 = it.kvh * group;
      const c10::BFloat16* keys = kp + it.kvh * dim;
      const c10::BFloat16* values = vp + it.kvh * dim;
      const int64_t* table = tables + e * bt_stride;
      const c10::BFloat16* q = qp + tok[e] * qs0 + h0 * qs1;
      c10::BFloat16* out = op + tok[e] * os0 + h0 * os1;
      const int64_t first_pos = lens[e] - 1;
      switch (dim) {
        case 64:
          prefill_block<64>(keys, values, row, table, block_size, q, qs0, qs1, it.nq, first_pos,
                            group, scale, cap, window, out, os0, os1, s);
          break;
        case 128:
          prefill_block<128>(keys, values, row, table, block_size, q, qs0, qs1, it.nq,
                             first_pos, group, scale, cap, window, out, os0, os1, s);
          break;
        default:
          prefill_block<256>(keys, values, row, table, block_size, q, qs0, qs1, it.nq,
                             first_pos, group, scale, cap, window, out, os0, os1, s);
          break;
      }
    }
  });
}
#endif

// One query token per request over its paged context. A work item is a request, or with fewer
// requests than threads a range of its keys (flash-decoding: one long request keeps every thread
// busy, and the ranges' unnormalized sums are merged by their peak scores afterwards). Each item
// takes all heads; the query heads sharing a KV head read the same keys, from L1 after the
// first. Scores are exact (logits, then a max-subtracted softmax), matching the reference up to
// float rounding.
template <typename q_t, typename cache_t>
void decode_attention_typed(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& kc,
                            const torch::Tensor& vc, const torch::Tensor& token_index,
                            const torch::Tensor& block_table, const torch::Tensor& seq_lens,
                            double scale, double softcap, int64_t window) {
  const int64_t num_req = token_index.size(0);
  const int64_t heads = q.size(1), dim = q.size(2);
  const int64_t block_size = kc.size(1), kv_heads = kc.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * dim;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const int64_t bt_stride = block_table.stride(0);
  const q_t* qp = q.data_ptr<q_t>();
  q_t* op = out.data_ptr<q_t>();
  const cache_t* kp = kc.data_ptr<cache_t>();
  const cache_t* vp = vc.data_ptr<cache_t>();
  const int64_t* tok = token_index.data_ptr<int64_t>();
  const int64_t* tables = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  // Prompt tokens go in runs to prefill_block; the rest (`single`, indices of entries) below.
  std::vector<QueryRun> runs;
  std::vector<int64_t> single;
  if (runs_supported<q_t, cache_t>(dim)) {
    split_runs(num_req, tok, lens, tables, bt_stride, block_size, runs, single);
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<q_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>)
      if (!runs.empty())
        prefill_runs(runs, qp, qs0, qs1, op, os0, os1, kp, vp, row, dim, kv_heads, group, tok,
                     lens, tables, bt_stride, block_size, fscale, fcap, window);
#endif
  } else {
    single.resize(num_req);
    std::iota(single.begin(), single.end(), int64_t{0});
  }
  const int64_t num_single = static_cast<int64_t>(single.size());
  if (num_single == 0) return;
  const int64_t threads = at::get_num_threads();
  // Key ranges per request: enough items to be a multiple of the thread count.
  const int64_t ranges = num_single >= threads ? 1 : threads / std::gcd(num_single, threads);
  const int64_t items = num_single * ranges;
  const int64_t width = heads * dim;
  // Partial results of split requests: unnormalized sums, peaks and exp totals per head.
  std::vector<float> part_acc(ranges > 1 ? items * width : 0);
  std::vector<float> part_peak(ranges > 1 ? items * heads : 0), part_total(part_peak.size());

  // Item i's keys: a range [lo, lo + n) of entry single[i / ranges]'s context.
  auto key_range = [&](int64_t item) {
    const int64_t r = single[item / ranges], c = item % ranges, len = lens[r];
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t lo = first + (len - first) * c / ranges;
    return std::make_pair(lo, first + (len - first) * (c + 1) / ranges - lo);
  };
  // Its slots, walked block by block (an integer division per key costs more than the key's
  // dot products).
  auto item_slots = [&](int64_t item, std::vector<int64_t>& out) {
    const auto [lo, n] = key_range(item);
    const int64_t* table = tables + single[item / ranges] * bt_stride;
    out.resize(n);
    for (int64_t j = 0, pos = lo; j < n;) {
      const int64_t base = table[pos / block_size] * block_size;
      for (int64_t off = pos % block_size; off < block_size && j < n; ++off, ++j, ++pos)
        out[j] = base + off;
    }
  };

  // Items go longest first to whichever thread is free: a static split gave one thread the
  // longer contexts. A thread claims its next item before computing the current one, so that
  // item's rows can stream in meanwhile.
  std::vector<int64_t> order(items);
  std::iota(order.begin(), order.end(), int64_t{0});
  if (ranges == 1)
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return lens[single[a]] > lens[single[b]];
    });
  std::atomic<int64_t> claimed{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> qf(width), acc(width), peak(heads), total(heads), row_f(dim), scores;
    std::vector<int64_t> slots, next_slots;
    KvPrefetch pf{reinterpret_cast<const char*>(kp), reinterpret_cast<const char*>(vp),
                  static_cast<int64_t>(row * sizeof(cache_t))};
    int64_t at = claimed.fetch_add(1);
    if (at >= items) return;
    item_slots(order[at], next_slots);
    if (static_cast<int64_t>(next_slots.size()) * pf.row_bytes * 2 <= kBurstBytes)  // see there
      for (const int64_t slot : next_slots) pf.fetch_row(slot);
    for (bool first = true; at < items; first = false) {
      const int64_t item = order[at];
      const int64_t r = single[item / ranges];
      at = claimed.fetch_add(1);
      slots.swap(next_slots);
      next_slots.clear();
      const int64_t n = static_cast<int64_t>(slots.size());
      // The next item's rows stream in while this one computes, unless it reads this item's
      // keys again (a prompt's next token: same first and last slot of this range; requests
      // that share only a cached prefix block differ in the last).
      if (at < items) {
        item_slots(order[at], next_slots);
        const bool same = !slots.empty() && next_slots.size() >= slots.size() &&
                          slots[0] == next_slots[0] && slots.back() == next_slots[slots.size() - 1];
        pf.start(next_slots.data(), same ? 0 : static_cast<int64_t>(next_slots.size()));
      } else {
        pf.start(nullptr, 0);
      }
      KvPrefetch* stream = pf.next_n > 0 ? &pf : nullptr;
      if (n > 0) {
        scores.resize(heads * n);
        // The bf16 path (whole KV-head groups) where it applies, else float32 head by head,
        // else the generic loops.
        bool fast = true;
        for (int64_t kvh = 0; kvh < kv_heads && fast; ++kvh) {
          const int64_t h0 = kvh * group;
          fast = attend_kv_head(kp + kvh * dim, vp + kvh * dim, slots.data(), n, row, dim,
                                qp + tok[r] * qs0 + h0 * qs1, qs1, group, fscale, fcap,
                                scores.data() + h0 * n, acc.data() + h0 * dim, &peak[h0],
                                &total[h0], first || stream != nullptr ? &pf : nullptr,
                                kvh == 0 && first);
        }
        if (!fast) {  // the float32 paths take q widened
          for (int64_t h = 0; h < heads; ++h) {
            const q_t* src = qp + tok[r] * qs0 + h * qs1;
            for (int64_t d = 0; d < dim; ++d) qf[h * dim + d] = to_f(src[d]);
          }
          fast = true;
          for (int64_t h = 0; h < heads && fast; ++h) {
            const int64_t kvh = h / group;
            fast = attend_head(kp + kvh * dim, vp + kvh * dim, slots.data(), n, row, dim,
                               qf.data() + h * dim, fscale, fcap, scores.data() + h * n,
                               acc.data() + h * dim, &peak[h], &total[h]);
          }
        }
        if (!fast) {
          for (int64_t j = 0; j < n; ++j) {
            const cache_t* keys = kp + slots[j] * row;
            for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
              const int64_t q0 = kvh * group;
              float dots[kMaxGroup];
              dot_queries(keys + kvh * dim, qf.data() + q0 * dim, group, dim, row_f.data(), dots);
              for (int64_t g = 0; g < group; ++g) {
                float s = dots[g] * fscale;
                if (fcap > 0.f) s = std::tanh(s / fcap) * fcap;
                scores[(q0 + g) * n + j] = s;
              }
            }
          }
          for (int64_t h = 0; h < heads; ++h) {
            float* sh = scores.data() + h * n;
            peak[h] = peak_of(sh, n);
            total[h] = exp_shifted(sh, n, peak[h]);
          }
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t j = 0; j < n; ++j) {
            const cache_t* values = vp + slots[j] * row;
            for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
              const int64_t q0 = kvh * group;
              float probs[kMaxGroup];
              for (int64_t g = 0; g < group; ++g) probs[g] = scores[(q0 + g) * n + j];
              add_scaled(values + kvh * dim, probs, group, dim, row_f.data(),
                         acc.data() + q0 * dim);
            }
          }
        }
      } else {  // an empty range (a context shorter than the ranges): weighs nothing
        std::fill(acc.begin(), acc.end(), 0.f);
        std::fill(peak.begin(), peak.end(), -std::numeric_limits<float>::infinity());
        std::fill(total.begin(), total.end(), 0.f);
      }
      if (ranges > 1) {
        std::copy(acc.begin(), acc.end(), part_acc.begin() + item * width);
        std::copy(peak.begin(), peak.end(), part_peak.begin() + item * heads);
        std::copy(total.begin(), total.end(), part_total.begin() + item * heads);
        continue;
      }
      for (int64_t h = 0; h < heads; ++h) {
        q_t* dst = op + tok[r] * os0 + h * os1;
        const float inv = 1.f / total[h];
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<q_t>(acc[h * dim + d] * inv);
      }
    }
  });
  if (ranges == 1) return;
  std::vector<float> weights(ranges);
  for (int64_t i = 0; i < num_single; ++i) {  // fewer requests than threads: a few heads to merge
    const int64_t r = single[i], item0 = i * ranges;
    for (int64_t h = 0; h < heads; ++h) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < ranges; ++c) top = std::max(top, part_peak[(item0 + c) * heads + h]);
      float denom = 0.f;
      for (int64_t c = 0; c < ranges; ++c) {
        const int64_t at = (item0 + c) * heads + h;
        weights[c] = part_total[at] > 0.f ? std::exp(part_peak[at] - top) : 0.f;
        denom += weights[c] * part_total[at];
      }
      q_t* dst = op + tok[r] * os0 + h * os1;
      for (int64_t d = 0; d < dim; ++d) {
        float sum = 0.f;
        for (int64_t c = 0; c < ranges; ++c)
          sum += weights[c] * part_acc[(item0 + c) * width + h * dim + d];
        dst[d] = static_cast<q_t>(sum / denom);
      }
    }
  }
}

// One row of RMSNorm; the residual-add variant below calls it too, so both round alike.
template <typename T>
inline void rms_norm_row(const T* xr, const T* wp, T* orow, int64_t width, float eps) {
#if defined(__AVX512F__)
  if constexpr (kVec16<T>) {
    if (width % 16 == 0) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < width; i += 16) {
        const __m512 v = load16(xr + i);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / width + eps));
      for (int64_t i = 0; i < width; i += 16)
        store16(orow + i, _mm512_mul_ps(round16<T>(_mm512_mul_ps(load16(xr + i), inv)),
                                        load16(wp + i)));
      return;
    }
  }
#endif
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < width; ++i) sq += to_f(xr[i]) * to_f(xr[i]);
  const float inv = 1.f / std::sqrt(sq / width + eps);
  // The normalized value is rounded to the input dtype before the weight is applied, as
  // the reference implementations do.
  for (int64_t i = 0; i < width; ++i)
    orow[i] = static_cast<T>(to_f(static_cast<T>(to_f(xr[i]) * inv)) * to_f(wp[i]));
}

template <typename T>
void rms_norm_typed(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& weight,
                    double eps) {
  const int64_t rows = x.size(0), width = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rms_norm_row(xp + r * width, wp, op + r * width, width, static_cast<float>(eps));
  });
}

// Rotate-half RoPE of one head in place.
template <typename T>
inline void rotate_half(T* v, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (kVec16<T>) {
    for (; i + 16 <= half; i += 16) {
      const __m512 a = load16(v + i), b = load16(v + i + half);
      const __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
      store16(v + i, _mm512_fmsub_ps(a, cv, _mm512_mul_ps(b, sv)));
      store16(v + i + half, _mm512_fmadd_ps(b, cv, _mm512_mul_ps(a, sv)));
    }
  }
#endif
  for (; i < half; ++i) {
    const float a = to_f(v[i]), b = to_f(v[i + half]);
    v[i] = static_cast<T>(a * c[i] - b * s[i]);
    v[i + half] = static_cast<T>(b * c[i] + a * s[i]);
  }
}

// Rotate-half RoPE applied in place to x [T, heads, dim] (any strides with a unit last stride).
template <typename T>
void rotary_typed(torch::Tensor& x, const int64_t* pos, const float* cos, const float* sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  T* xp = x.data_ptr<T>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * half;
      const float* s = sin + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) rotate_half(xp + t * s0 + h * s1, c, s, half);
    }
  });
}

// A decoder layer's residual add and the norm after it in one pass: x += delta (rounded to T, as
// x + delta is), then out = rms_norm(x) with the rounding of rms_norm_typed. x is [rows, width]
// contiguous; delta's rows are `delta_stride` apart (a narrowed projection output).
template <typename T>
void add_rms_norm_typed(T* x, const T* delta, int64_t delta_stride, const T* weight, T* out,
                        int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * width;
      const T* dr = delta + r * delta_stride;
      int64_t i = 0;
#if defined(__AVX512F__)
      if constexpr (kVec16<T>)
        for (; i + 16 <= width; i += 16) store16(xr + i, _mm512_add_ps(load16(xr + i), load16(dr + i)));
#endif
      for (; i < width; ++i) xr[i] = static_cast<T>(to_f(xr[i]) + to_f(dr[i]));
      rms_norm_row(xr, weight, out + r * width, width, eps);
    }
  });
}

// The q and k heads of a fused qkv row normed (Qwen3's q_norm / k_norm, when given) and rotated
// in place, and the k and v rows written to their cache slots: what rms_norm, rotary_typed and
// write_rows do, without a tensor view per head group. qkv rows are `stride` apart; the cache is
// T, like the activations.
template <typename T>
void rope_write_kv_typed(T* qkv, int64_t tokens, int64_t stride, int64_t heads, int64_t kv_heads,
                         int64_t dim, const int64_t* pos, const float* cos, const float* sin,
                         const T* q_norm, const T* k_norm, float eps, T* k_cache, T* v_cache,
                         const int64_t* slots) {
  const int64_t half = dim / 2, kv_width = kv_heads * dim;
  // A prefill's thousands of tokens are split between the threads; a decode step's few run
  // inline (no fork).
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * stride;
      const float* c = cos + pos[t] * half;
      const float* s = sin + pos[t] * half;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        T* head = row + h * dim;
        const T* norm = h < heads ? q_norm : k_norm;
        if (norm != nullptr) rms_norm_row(head, norm, head, dim, eps);
        rotate_half(head, c, s, half);
      }
      std::copy(row + heads * dim, row + heads * dim + kv_width, k_cache + slots[t] * kv_width);
      std::copy(row + heads * dim + kv_width, row + heads * dim + 2 * kv_width,
                v_cache + slots[t] * kv_width);
    }
  });
}

#if defined(__AVX512F__)

// silu(gate) * up for 16 lanes, silu rounded to T first; T is float or bfloat16.
template <typename T>
inline void silu_mul16(const T* gate, const T* up, T* out) {
  const __m512 g = load16(gate);
  // g / (1 + e^-g) with a refined reciprocal (about 2^-28 relative) instead of a division,
  // whose 512-bit form is slow on this class of CPU. Below g = -80 silu is below 1e-33: 0 here
  // (e^-g is capped so that the reciprocal stays finite).
  const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), g);
  const __mmask16 live = _mm512_cmp_ps_mask(neg, _mm512_set1_ps(80.f), _CMP_LE_OQ);
  const __m512 den =
      _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_min_ps(neg, _mm512_set1_ps(80.f))));
  __m512 inv = _mm512_rcp14_ps(den);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
  const __m512 act = _mm512_maskz_mul_ps(live, g, inv);
  store16(out, _mm512_mul_ps(round16<T>(act), load16(up)));
}
#endif

template <typename T>
void silu_and_mul_typed(torch::Tensor& out, const torch::Tensor& x) {
  const int64_t rows = x.size(0), width = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // A decode step's few rows are a few microseconds of work: one thread, no fork.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * 2 * width;
      const T* up = gate + width;
      T* o = op + r * width;
      int64_t i = 0;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>)
        for (; i + 16 <= width; i += 16) silu_mul16(gate + i, up + i, o + i);
#elif defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, float>)  // std::exp a lane cost 0.9 ms a SmolLM2 step
        for (; i + 8 <= width; i += 8) {
          // As silu_mul16: below g = -80 silu is below 1e-33, 0 here.
          const __m256 g = _mm256_loadu_ps(gate + i);
          const __m256 neg = _mm256_sub_ps(_mm256_setzero_ps(), g);
          const __m256 live = _mm256_cmp_ps(neg, _mm256_set1_ps(80.f), _CMP_LE_OQ);
          const __m256 act = _mm256_and_ps(
              live, _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(neg))));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(act, _mm256_loadu_ps(up + i)));
        }
#endif
      for (; i < width; ++i) {
        const float g = to_f(gate[i]);
        // silu is rounded to the input dtype before the product, as in F.silu(gate) * up.
        const float act = to_f(static_cast<T>(g / (1.f + std::exp(-g))));
        o[i] = static_cast<T>(act * to_f(up[i]));
      }
    }
  });
}

// Int8 weights ([N, K], a float scale per output row) times a few rows of activations
// (decode). Reading the weights is the whole cost, so each weight row is read once for all rows
// of x and widened to float in registers. (int4: int4_block below.)

// How far ahead of its reads a decode GEMV asks for the weights it streams. A row block of
// int4 weights (16 rows: 4.6 KB for K = 576) or a few int8 rows cross a 4 KB page, where the
// hardware's stream prefetcher stops; on an Intel Xeon (KVM, 2 cores) one core then drew 8 GB/s
// from DRAM. With software prefetches this far ahead, 2 threads stream int4 weights at 17.7 GB/s
// against 11.3 and the int8 LM head at 21.5 against 13.5, and a batch-1 decode step of
// SmolLM2-135M fell from 10.4 to 6.8 ms. 2-6 KB measured alike; 1 KB was slower.
constexpr int64_t kPrefetchBytes = 3072;

inline void prefetch_lines(const void* p, int64_t bytes) {
#if defined(__AVX2__)
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(static_cast<const char*>(p) + i, _MM_HINT_T0);
#endif
}

template <typename T>
void widen_rows(const torch::Tensor& x, std::vector<float>& xf) {
  const int64_t n = x.numel();
  xf.resize(n);
  widen(x.data_ptr<T>(), xf.data(), n);
}

// One output row of an int8 weight against R rows of float activations.
template <int R>
inline void int8_row(const int8_t* w, const float* xf, int64_t k, float* dots) {
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (; i + 16 <= k; i += 16) {
    const __m512 wv = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i))));
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xf + r * k + i), wv, acc[r]);
  }
  for (int r = 0; r < R; ++r) dots[r] = _mm512_reduce_add_ps(acc[r]);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) {
    const __m256 wv = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + i))));
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + r * k + i), wv, acc[r]);
  }
  for (int r = 0; r < R; ++r) dots[r] = sum8(acc[r]);
#else
  for (int r = 0; r < R; ++r) dots[r] = 0.f;
#endif
  for (; i < k; ++i)
    for (int r = 0; r < R; ++r) dots[r] += xf[r * k + i] * static_cast<float>(w[i]);
}

// The same with a scale per `group` inputs (GGUF's Q8_0: 32): each group's dot products are
// summed, then scaled into the row's total.
template <int R>
inline void int8_row_grouped(const int8_t* w, const float* xf, int64_t k, int64_t group,
                             const float* scales, float* dots) {
#if defined(__AVX512F__)
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g0 = 0, gi = 0; g0 < k; g0 += group, ++gi) {
    __m512 part[R];
    for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_ps();
    for (int64_t i = g0; i < g0 + group; i += 16) {
      const __m512 wv = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i))));
      for (int r = 0; r < R; ++r)
        part[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xf + r * k + i), wv, part[r]);
    }
    const __m512 s = _mm512_set1_ps(scales[gi]);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(part[r], s, acc[r]);
  }
  for (int r = 0; r < R; ++r) dots[r] = _mm512_reduce_add_ps(acc[r]);
#elif defined(__AVX2__) && defined(__FMA__)
  // Two accumulators a row (even and odd 8 inputs): one chain of FMAs per row waited on itself.
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g0 = 0, gi = 0; g0 < k; g0 += group, ++gi) {
    const __m256 s = _mm256_set1_ps(scales[gi]);
    for (int64_t i = g0; i < g0 + group; i += 16) {
      // Each weight scaled first, as the dense weight w = d * q is, then multiplied.
      const __m256 w0 = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + i)))));
      const __m256 w1 = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + i + 8)))));
      for (int r = 0; r < R; ++r) {
        acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + r * k + i), w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + r * k + i + 8), w1, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) dots[r] = sum8(_mm256_add_ps(acc[r][0], acc[r][1]));
#else
  for (int r = 0; r < R; ++r) dots[r] = 0.f;
  for (int64_t g0 = 0, gi = 0; g0 < k; g0 += group, ++gi)
    for (int r = 0; r < R; ++r) {
      float part = 0.f;
      for (int64_t i = g0; i < g0 + group; ++i) part += xf[r * k + i] * static_cast<float>(w[i]);
      dots[r] += part * scales[gi];
    }
#endif
}

// R rows of x (float) times output rows [begin, end) of the int8 weights; `groups` = 0: one
// scale per row, else a scale per k / groups inputs.
template <typename T, int R>
void int8_rows_block(T* op, int64_t n, const float* xf, int64_t k, const int8_t* qp,
                     const float* sp, int64_t groups, int64_t begin, int64_t end) {
  float dots[R];
  for (int64_t o = begin; o < end; ++o) {
    prefetch_lines(qp + o * k + kPrefetchBytes, k);  // the row kPrefetchBytes on, its scales
    if (groups) {
      prefetch_lines(sp + o * groups + kPrefetchBytes / (k / groups), groups * 4);
      int8_row_grouped<R>(qp + o * k, xf, k, k / groups, sp + o * groups, dots);
      for (int r = 0; r < R; ++r) op[r * n + o] = static_cast<T>(dots[r]);
    } else {
      int8_row<R>(qp + o * k, xf, k, dots);
      for (int r = 0; r < R; ++r) op[r * n + o] = static_cast<T>(dots[r] * sp[o]);
    }
  }
}

// Runs body<R>() for R = rows (1..8): the row count is a template argument so that the
// accumulators stay in registers.
template <typename F>
void for_rows(int64_t rows, F&& body) {
  switch (rows) {
    case 1: body(std::integral_constant<int, 1>{}); break;
    case 2: body(std::integral_constant<int, 2>{}); break;
    case 3: body(std::integral_constant<int, 3>{}); break;
    case 4: body(std::integral_constant<int, 4>{}); break;
    case 5: body(std::integral_constant<int, 5>{}); break;
    case 6: body(std::integral_constant<int, 6>{}); break;
    case 7: body(std::integral_constant<int, 7>{}); break;
    case 8: body(std::integral_constant<int, 8>{}); break;
    default: TORCH_CHECK(false, "low-bit GEMV takes 1 to 8 rows, got ", rows);
  }
}

// Int4 weights times a few rows of bf16 activations (decode), in octavo's own layout
// (octavo/model/quant/packed.py, Int4Packed.native_layout) so that unpacking costs less than
// the multiply and a step reads the weights at memory speed:
//   q4 [N / 16, K / 4, 32] bytes: byte 2r + j of (row block b, quad c) holds the codes of row
//      16b + r at inputs 4c + j (low nibble) and 4c + 2 + j (high nibble);
//   sz [N / 16, K / 32, 2, 16]: per row and 32 inputs, either float32 scale and zero
//      (w = (q - 8) * scale + zero, torch's form) or, where a GGUF's Q4_0/Q4_1 gave them,
//      float16 scale and low (w = scale * q + low) exactly as the file stores them: zero is then
//      8 * scale + low, computed here with the float32 operations the packing would have run,
//      so the products are the same and a step reads 5/6 of the bytes (the float32 pair was a
//      third of them).
// A 32-bit lane is one output row, so products accumulate per row with no horizontal sums:
// code q becomes the bf16 number 128 + q by or-ing in an exponent (no conversion), vdpbf16ps
// multiplies pairs of inputs exactly into float32, and per group
//   sum x * w = scale * sum x * (128 + q) + (zero - 136 * scale) * sum x.
#if defined(__AVX512BF16__)
// Output rows 16b..16b+15 for R activation rows; acc[r] gets row r's 16 sums.
template <int R, typename S>
inline void int4_block(const uint8_t* q4, const S* sz, const c10::BFloat16* x,
                       int64_t k, const float* xsum, __m512* acc) {
  constexpr int P = R == 1 ? 2 : 1;  // one row alone: two chains per half, to hide latency
  const int64_t groups = k / 32;
  const __m512i low_nibble = _mm512_set1_epi16(0x0F), exponent = _mm512_set1_epi16(0x4300);
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[R][2 * P];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 2 * P; ++i) part[r][i] = _mm512_setzero_ps();
    const uint8_t* qg = q4 + g * 256;
    // The group kPrefetchBytes of codes on (in this block or a later one) and its scales.
    prefetch_lines(qg + kPrefetchBytes, 256);
    prefetch_lines(sz + g * 32 + kPrefetchBytes / 8, 32 * sizeof(S));
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m512i w = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + c * 32)));
      const __m512i lo = _mm512_ternarylogic_epi32(w, low_nibble, exponent, 0xEA);  // a&b | c
      const __m512i hi = _mm512_or_si512(_mm512_srli_epi16(w, 4), exponent);
      const int p = (c % P) * 2;
      for (int r = 0; r < R; ++r) {
        const int32_t* xr = reinterpret_cast<const int32_t*>(x + r * k + g * 32 + c * 4);
        part[r][p] = _mm512_dpbf16_ps(part[r][p], (__m512bh)lo, (__m512bh)_mm512_set1_epi32(xr[0]));
        part[r][p + 1] =
            _mm512_dpbf16_ps(part[r][p + 1], (__m512bh)hi, (__m512bh)_mm512_set1_epi32(xr[1]));
      }
    }
    __m512 scale, zero;
    if constexpr (std::is_same_v<S, float>) {
      scale = _mm512_loadu_ps(sz + g * 32);
      zero = _mm512_loadu_ps(sz + g * 32 + 16);
    } else {
      scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + g * 32)));
      const __m512 low = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + g * 32 + 16)));
      zero = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(8.f), scale), low);
    }
    const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), scale, zero);
    for (int r = 0; r < R; ++r) {
      __m512 dot = _mm512_add_ps(part[r][0], part[r][1]);
      if constexpr (P == 2) dot = _mm512_add_ps(dot, _mm512_add_ps(part[r][2], part[r][3]));
      acc[r] = _mm512_fmadd_ps(dot, scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The same layout times a few rows of float32 activations, for CPUs without AVX-512-BF16 (where
// the model computes in float32). A 32-bit lane is one output row again: a row's two bytes of a
// quad, widened to 32 bits, hold its codes for inputs 4c, 4c + 2, 4c + 1, 4c + 3 at bits 0, 4,
// 8 and 12. Each code is masked in place, not shifted down, and converts to q * 16^i; the
// activations come prescaled by 16^-i (a power of two: exact) and in that order (xs, see
// int4_gemm), so one AND, one conversion and one FMA make a lane's product. Per group,
//   sum x * w = scale * sum x * q + offset * sum x,
// with offset = low (w = scale * q + low, a GGUF's form) or zero - 8 * scale (torch's form).
// Output rows 16b..16b+15 of R activation rows go to out + r * out_stride.
template <int R, typename S>
inline void int4_block_f32(const uint8_t* q4, const S* sz, const float* xs, int64_t k,
                           const float* xsum, float* out, int64_t out_stride) {
  constexpr int P = R == 1 ? 2 : 1;  // one row alone: two chains per half, to hide latency
  const int64_t groups = k / 32;
  const __m256i mask[4] = {_mm256_set1_epi32(0xF), _mm256_set1_epi32(0xF0),
                           _mm256_set1_epi32(0xF00), _mm256_set1_epi32(0xF000)};
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 part[R][2][P];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        for (int p = 0; p < P; ++p) part[r][h][p] = _mm256_setzero_ps();
    const uint8_t* qg = q4 + g * 256;
    prefetch_lines(qg + kPrefetchBytes, 256);
    prefetch_lines(sz + g * 32 + kPrefetchBytes / 8, 32 * sizeof(S));
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      __m256i v[2];
      for (int h = 0; h < 2; ++h)
        v[h] = _mm256_cvtepu16_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + c * 32 + h * 16)));
      for (int i = 0; i < 4; ++i) {
        const int p = i % P;
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_and_si256(v[0], mask[i]));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_and_si256(v[1], mask[i]));
        for (int r = 0; r < R; ++r) {
          const __m256 xv = _mm256_broadcast_ss(xs + r * k + g * 32 + c * 4 + i);
          part[r][0][p] = _mm256_fmadd_ps(q0, xv, part[r][0][p]);
          part[r][1][p] = _mm256_fmadd_ps(q1, xv, part[r][1][p]);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 scale, offset;
      if constexpr (std::is_same_v<S, float>) {
        scale = _mm256_loadu_ps(sz + g * 32 + 8 * h);
        offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), scale, _mm256_loadu_ps(sz + g * 32 + 16 + 8 * h));
      } else {
        scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sz + g * 32 + 8 * h)));
        offset = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sz + g * 32 + 16 + 8 * h)));
      }
      for (int r = 0; r < R; ++r) {
        __m256 dot = part[r][h][0];
        if constexpr (P == 2) dot = _mm256_add_ps(dot, part[r][h][1]);
        acc[r][h] = _mm256_fmadd_ps(dot, scale, acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(xsum[r * groups + g]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * out_stride + 8 * h, acc[r][h]);
}
#endif

void check_cache(const torch::Tensor& kc, const torch::Tensor& vc) {
  TORCH_CHECK(kc.dim() == 4 && kc.is_contiguous() && vc.is_contiguous(),
              "cache must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(kc.scalar_type() == vc.scalar_type(), "K and V caches differ in dtype");
}

}  // namespace

void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t n = slot_mapping.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "write_kv_c",
                                  [&] { write_kv_typed<scalar_t>(k, v, k_cache, v_cache, slots, n); });
}

void decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor token_index, torch::Tensor block_table,
                      torch::Tensor seq_lens, double scale, double softcap, int64_t window) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "out and q differ in dtype");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(1) / k_cache.size(2) <= kMaxGroup, "too many query heads per KV head");
  TORCH_CHECK(token_index.is_contiguous() && seq_lens.is_contiguous() &&
              block_table.stride(1) == 1, "index tensors must be contiguous");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_q", [&] {
    using q_t = scalar_t;
    if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {  // fp8 cache: the caller folds in scales
      decode_attention_typed<q_t, c10::Float8_e4m3fn>(out, q, k_cache, v_cache, token_index,
                                                      block_table, seq_lens, scale, softcap,
                                                      window);
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "decode_c",
                                    [&] {
      decode_attention_typed<q_t, scalar_t>(out, q, k_cache, v_cache, token_index, block_table,
                                            seq_lens, scale, softcap, window);
    });
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm needs contiguous inputs");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm weight dtype differs");
  auto flat = x.view({-1, x.size(-1)});
  auto out = torch::empty_like(flat);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_typed<scalar_t>(out, flat, weight, eps);
  });
  return out.view(x.sizes());
}

void rotary_inplace(torch::Tensor x, torch::Tensor positions, torch::Tensor cos,
                    torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary needs [T, heads, dim], dim contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous());
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous());
  TORCH_CHECK(cos.size(1) * 2 == x.size(2), "rotary table width must be head_dim / 2");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    rotary_typed<scalar_t>(x, positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                           sin.data_ptr<float>());
  });
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul needs a contiguous [T, 2 * width] input");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul",
                                  [&] { silu_and_mul_typed<scalar_t>(out, x); });
  return out;
}

torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor q, torch::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && q.is_contiguous() && scale.is_contiguous());
  TORCH_CHECK(q.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat);
  TORCH_CHECK(x.size(1) == q.size(1), "int8_gemv: inner sizes differ");
  TORCH_CHECK(scale.size(0) == q.size(0) && (scale.dim() == 1 ||
              (scale.dim() == 2 && q.size(1) % scale.size(1) == 0 &&
               (q.size(1) / scale.size(1)) % 16 == 0)),
              "int8_gemv: scale must be [N] or [N, G] with groups of a multiple of 16 inputs");
  const int64_t rows = x.size(0), n = q.size(0), k = q.size(1);
  const int64_t groups = scale.dim() == 2 ? scale.size(1) : 0;
  auto out = torch::empty({rows, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int8_gemv", [&] {
    std::vector<float> xf;
    widen_rows<scalar_t>(x, xf);
    scalar_t* op = out.data_ptr<scalar_t>();
    // Each thread takes a block of 64 weight rows (tens of KB: they stay in L2) and runs every
    // chunk of up to 8 activation rows over it, so the weights come from memory once.
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t c = 0; c < rows; c += 8) {
        for_rows(std::min<int64_t>(8, rows - c), [&](auto r) {
          int8_rows_block<scalar_t, decltype(r)::value>(
              op + c * n, n, xf.data() + c * k, k, q.data_ptr<int8_t>(), scale.data_ptr<float>(),
              groups, begin, end);
        });
      }
    });
  });
  return out;
}

bool built_with_avx512_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

bool built_with_avx2() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

// x [M, K] float32 times int4 weights in octavo's layout -> [M, N] float32 (int4_block_f32).
torch::Tensor int4_gemm_f32(const torch::Tensor& x, const torch::Tensor& q4, const torch::Tensor& sz,
                            bool half_scales) {
  TORCH_CHECK(built_with_avx2(), "int4_gemm with float32 activations needs AVX2 and FMA");
  const int64_t rows = x.size(0), k = x.size(1), blocks = q4.size(0), n = blocks * 16;
  auto out = torch::empty({rows, n}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t groups = k / 32;
  const float* xp = x.data_ptr<float>();
  // Each row's inputs in the kernel's order (4c, 4c + 2, 4c + 1, 4c + 3), scaled by 16^-i, and
  // its sum over each group of 32.
  std::vector<float> xs(rows * k), xsum(rows * groups);
  constexpr int kOrder[4] = {0, 2, 1, 3};
  constexpr float kScale[4] = {1.f, 1.f / 16, 1.f / 256, 1.f / 4096};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < k; c += 4)
      for (int i = 0; i < 4; ++i) xs[r * k + c + i] = xp[r * k + c + kOrder[i]] * kScale[i];
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < 32; ++i) s += xp[r * k + g * 32 + i];
      xsum[r * groups + g] = s;
    }
  }
  const uint8_t* qp = q4.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  auto run = [&](const auto* sp) {
    // A row block (k / 2 bytes) stays in L1 for every chunk of 4 rows of x.
    at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        for (int64_t c = 0; c < rows; c += 4) {
          const int64_t m = std::min<int64_t>(4, rows - c);
          for_rows(m, [&](auto r) {
            if constexpr (decltype(r)::value <= 4)
              int4_block_f32<decltype(r)::value>(qp + b * k * 8, sp + b * groups * 32,
                                                 xs.data() + c * k, k, xsum.data() + c * groups,
                                                 op + c * n + b * 16, n);
          });
        }
    });
  };
  if (half_scales)
    run(sz.data_ptr<at::Half>());
  else
    run(sz.data_ptr<float>());
#endif
  return out;
}

// x [M, K] bf16 or float32 times int4 weights in octavo's layout (see int4_block) -> [M, N] in
// x's dtype, with N the padded row count (a multiple of 16).
torch::Tensor int4_gemm(torch::Tensor x, torch::Tensor q4, torch::Tensor sz) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
              (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "int4_gemm: x must be a contiguous [M, K] bf16 or float32 tensor");
  TORCH_CHECK(q4.dim() == 3 && q4.size(2) == 32 && q4.scalar_type() == at::kByte &&
              q4.is_contiguous(), "int4_gemm: codes must be [N / 16, K / 4, 32] uint8");
  const int64_t rows = x.size(0), k = x.size(1), blocks = q4.size(0), n = blocks * 16;
  TORCH_CHECK(k % 32 == 0 && q4.size(1) * 4 == k, "int4_gemm: K must match, a multiple of 32");
  const bool half_scales = sz.scalar_type() == at::kHalf;
  TORCH_CHECK((half_scales || sz.scalar_type() == at::kFloat) && sz.is_contiguous() &&
              sz.numel() == blocks * (k / 32) * 32,
              "int4_gemm: scales must be [N/16, K/32, 2, 16] float32 or float16");
  if (x.scalar_type() == at::kFloat) return int4_gemm_f32(x, q4, sz, half_scales);
  TORCH_CHECK(built_with_avx512_bf16(), "int4_gemm with bf16 activations needs AVX-512-BF16");
  auto out = torch::empty({rows, n}, x.options());
#if defined(__AVX512BF16__)
  const int64_t groups = k / 32;
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  std::vector<float> xsum(rows * groups);  // each row's sum over each group of 32 inputs
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < 32; ++i) s += static_cast<float>(xp[r * k + g * 32 + i]);
      xsum[r * groups + g] = s;
    }
  const uint8_t* qp = q4.data_ptr<uint8_t>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  auto run = [&](const auto* sp) {
    // A row block is k / 2 bytes (a few KB): it stays in L1 for every chunk of 8 rows of x.
    at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
      __m512 acc[8];
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t c = 0; c < rows; c += 8) {
          const int64_t m = std::min<int64_t>(8, rows - c);
          for_rows(m, [&](auto r) {
            int4_block<decltype(r)::value>(qp + b * k * 8, sp + b * groups * 32, xp + c * k, k,
                                           xsum.data() + c * groups, acc);
          });
          for (int64_t r = 0; r < m; ++r) store16(op + (c + r) * n + b * 16, acc[r]);
        }
      }
    });
  };
  if (half_scales)
    run(sz.data_ptr<at::Half>());
  else
    run(sz.data_ptr<float>());
#endif
  return out;
}

// The decoder stack of a Llama-family model for a step whose attention the in-place kernel
// takes whole (decodes, short queries, prompts: one attention entry per query token), as
// one call: the same kernels the Python layers call, without a Python frame and a dozen
// dispatches per layer around each of them (about 3 ms a step for a 30-layer model, a third of
// a batch-1 decode step). octavo/model/decode_stack.py builds it and checks what it supports.
struct StackLinear {
  torch::Tensor dense;  // [N, K], the weight every batch size can use; undefined: packed only
  torch::Tensor bias;   // [N] or undefined
  int64_t kind = 0;     // packed weight: 0 none, 4 int4 (torch's layout), 5 int4 (octavo's
                        // layout, see int4_block), 8 int8
  torch::Tensor low_a;  // int4: packed codes (N padded to 16); int8: codes [N, K]
  torch::Tensor low_b;  // int4: scales and zeros (torch: [K / 32, N, 2]); int8: float scale per row
  int64_t out = 0;      // N
  int64_t max_rows = 0;  // with a dense weight: the most rows the packed one serves (decode)

  // Alone, the packed weight serves every batch the stack is given (DecodeStack.max_tokens
  // keeps those small).
  torch::Tensor operator()(const torch::Tensor& x) const {
    if (kind != 0 && (!dense.defined() || x.size(0) <= max_rows)) {
      auto y = kind == 5   ? int4_gemm(x, low_a, low_b)
               : kind == 4 ? at::_weight_int4pack_mm_for_cpu(x, low_a, 32, low_b)
                           : int8_gemv(x, low_a, low_b);
      if (y.size(1) != out) y = y.narrow(1, 0, out);
      return bias.defined() ? y + bias : y;
    }
    // The bias is added after the product, as the Python layer adds it (one rounding each).
    auto y = dense.is_mkldnn() ? packed_linear(x, dense) : at::linear(x, dense);
    return bias.defined() ? y + bias : y;
  }

  // A weight packed by octavo/kernels/onednn.py: oneDNN's linear op, as its Python side calls it.
  static torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& weight) {
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x, weight, c10::IValue(), std::string("none"),
                            c10::List<std::optional<at::Scalar>>(), c10::IValue()};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
};

struct StackLayer {
  torch::Tensor input_norm, post_norm, q_norm, k_norm;  // q_norm / k_norm: Qwen3, else undefined
  StackLinear qkv, o, gate_up, down;
  torch::Tensor k_cache, v_cache;  // [num_blocks, block_size, kv_heads, head_dim]
};

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
              torch::Tensor cos, torch::Tensor sin)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        cos_(std::move(cos)), sin_(std::move(sin)) {}

  // Linears are (dense, bias or None, kind, low_a or None, low_b or None) tuples.
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm,
                 c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
                 std::vector<StackLinear> linears, torch::Tensor kv_cache) {
    TORCH_CHECK(linears.size() == 4, "a layer has qkv, o, gate_up and down projections");
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv cache must be [2, ...]");
    StackLayer l;
    l.input_norm = std::move(input_norm);
    l.post_norm = std::move(post_norm);
    if (q_norm) l.q_norm = *q_norm;
    if (k_norm) l.k_norm = *k_norm;
    l.qkv = linears[0]; l.o = linears[1]; l.gate_up = linears[2]; l.down = linears[3];
    l.k_cache = kv_cache[0];
    l.v_cache = kv_cache[1];
    check_cache(l.k_cache, l.v_cache);
    layers_.push_back(std::move(l));
  }

  // x: [T, hidden] embeddings of the step's tokens (token_index maps attention entries to them)
  // -> hidden states before the final norm.
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, torch::Tensor token_index,
                        torch::Tensor block_table, torch::Tensor seq_lens,
                        torch::Tensor slot_mapping) const {
    const int64_t t = x.size(0);
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    TORCH_CHECK(x.is_contiguous() && positions.is_contiguous() && slot_mapping.is_contiguous(),
                "the stack takes contiguous inputs");
    x = x.clone();  // the residual stream, updated in place
    torch::Tensor pending;  // the last down projection, added with the next layer's norm
    for (const StackLayer& l : layers_) {
      auto xn = pending.defined() ? add_rms_norm(x, pending, l.input_norm)
                                  : rms_norm(x, l.input_norm, eps_);
      auto qkv = l.qkv(xn);
      auto q = qkv.narrow(1, 0, q_size).view({t, heads_, head_dim_});
      TORCH_CHECK(qkv.stride(1) == 1, "qkv rows must be contiguous");
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_kv", [&] {
        const bool normed = l.q_norm.defined();  // Qwen3: q and k normed before the rotation
        rope_write_kv_typed<scalar_t>(
            qkv.data_ptr<scalar_t>(), t, qkv.stride(0), heads_, kv_heads_, head_dim_,
            positions.data_ptr<int64_t>(), cos_.data_ptr<float>(), sin_.data_ptr<float>(),
            normed ? l.q_norm.data_ptr<scalar_t>() : nullptr,
            normed ? l.k_norm.data_ptr<scalar_t>() : nullptr, static_cast<float>(eps_),
            l.k_cache.data_ptr<scalar_t>(), l.v_cache.data_ptr<scalar_t>(),
            slot_mapping.data_ptr<int64_t>());
      });
      auto attn = torch::empty({t, heads_, head_dim_}, x.options());
      decode_attention(attn, q, l.k_cache, l.v_cache, token_index, block_table, seq_lens, scale_,
                       0.0, 0);
      auto h = l.gate_up(add_rms_norm(x, l.o(attn.view({t, q_size})), l.post_norm));
      pending = l.down(silu_and_mul(h));
    }
    if (pending.defined()) x += pending;
    return x;
  }

 private:
  // x += delta in place; returns rms_norm(x) with `weight`.
  torch::Tensor add_rms_norm(torch::Tensor& x, const torch::Tensor& delta,
                             const torch::Tensor& weight) const {
    TORCH_CHECK(delta.stride(1) == 1 && delta.scalar_type() == x.scalar_type());
    auto out = torch::empty_like(x);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms", [&] {
      add_rms_norm_typed<scalar_t>(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(),
                                   delta.stride(0), weight.data_ptr<scalar_t>(),
                                   out.data_ptr<scalar_t>(), x.size(0), x.size(1),
                                   static_cast<float>(eps_));
    });
    return out;
  }

  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
  torch::Tensor cos_, sin_;
  std::vector<StackLayer> layers_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemv", &int8_gemv);
  m.def("int4_gemm", &int4_gemm);
  m.attr("has_int4_gemm") = built_with_avx512_bf16();  // a constant of the build: no call per use
  m.attr("has_int4_gemm_f32") = built_with_avx2();
  m.attr("has_prompt_runs") = built_with_avx512_bf16();
  m.def("write_kv", &write_kv);
  m.def("decode_attention", &decode_attention);
  m.def("rms_norm", &rms_norm);
  m.def("rotary_inplace", &rotary_inplace);
  m.def("silu_and_mul", &silu_and_mul);
  py::class_<StackLinear>(m, "StackLinear")
      .def(py::init([](c10::optional<torch::Tensor> dense, c10::optional<torch::Tensor> bias,
                       int64_t kind, c10::optional<torch::Tensor> low_a,
                       c10::optional<torch::Tensor> low_b, int64_t out, int64_t max_rows) {
        TORCH_CHECK(kind == 0 || kind == 4 || kind == 5 || kind == 8, "kind must be 0, 4, 5 or 8");
        TORCH_CHECK(kind == 0 || (low_a && low_b), "a low-bit kind needs its tensors");
        TORCH_CHECK(dense || kind != 0, "a linear needs a dense or a packed weight");
        StackLinear lin;
        if (dense) lin.dense = *dense;
        lin.out = out;
        if (bias) lin.bias = *bias;
        lin.kind = kind;
        if (low_a) lin.low_a = *low_a;
        if (low_b) lin.low_b = *low_b;
        lin.max_rows = max_rows;
        return lin;
      }));
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t, double, double, torch::Tensor, torch::Tensor>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>());
}
