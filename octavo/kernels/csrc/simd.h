// The kernels' building blocks: writing K and V rows to their cache slots, widening, 16- and
// 8-lane loads, stores and rounding, exp/tanh and softmax helpers (AVX-512, AVX2, scalar).
// Included by both translation units (cpu_ops.cpp, decode_stack.cpp): each compiles what it
// calls.
#pragma once

#include <ATen/ATen.h>

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
void write_rows(const at::Tensor& src, at::Tensor& cache, const int64_t* slots, int64_t n) {
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
void write_kv_typed(const at::Tensor& k, const at::Tensor& v, at::Tensor& kc,
                    at::Tensor& vc, const int64_t* slots, int64_t n) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    write_rows<scalar_t, cache_t>(k, kc, slots, n);
    write_rows<scalar_t, cache_t>(v, vc, slots, n);
  });
}

constexpr int64_t kMaxGroup = 64;  // query heads per KV head

#if defined(__AVX2__)
// Horizontal sum and maximum of 8 floats.
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

#endif

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// 16 float8_e4m3fn bytes as floats times 2^-8: each byte becomes a float16 (the sign kept, the
// exponent and mantissa shifted one bit down: float16's exponent bias is 8 more than e4m3's),
// which widens exactly, subnormals included. The one e4m3 decode: the fp8 KV cache's rows
// (load16) and the microscaled GEMVs' codes (microscaled_avx512.h; decode8_e4m3 is its 8-lane
// AVX2 form) both take it.
inline __m512 decode16_e4m3(const uint8_t* c) {
  const __m256i high = _mm256_slli_epi16(
      _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))), 8);
  return _mm512_cvtph_ps(
      _mm256_and_si256(_mm256_srai_epi16(high, 1), _mm256_set1_epi16(static_cast<short>(0xBFFF))));
}
inline __m512 load16(const c10::Float8_e4m3fn* p) {  // the fp8 KV cache
  return _mm512_mul_ps(decode16_e4m3(reinterpret_cast<const uint8_t*>(p)),
                       _mm512_set1_ps(256.f));
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

}  // namespace
