// Low-bit decode GEMVs: int8 rows (per channel or grouped) and octavo's int4 layout
// against bf16 or float32 activations, with software prefetch of the streamed weights.
// Included by cpu_ops.cpp only: the kernels are one translation unit, so every call
// between these files can still be inlined.
#pragma once

#include "simd.h"

namespace {

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
// summed, then scaled into the row's total. Scales are float32, or float16 where they are
// exactly that (Q8_0's own): 2 bytes a group instead of 4.
template <int R, typename S>
inline void int8_row_grouped(const int8_t* w, const float* xf, int64_t k, int64_t group,
                             const S* scales, float* dots) {
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
    const __m512 s = _mm512_set1_ps(static_cast<float>(scales[gi]));
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(part[r], s, acc[r]);
  }
  for (int r = 0; r < R; ++r) dots[r] = _mm512_reduce_add_ps(acc[r]);
#elif defined(__AVX2__) && defined(__FMA__)
  // Two accumulators a row (even and odd 8 inputs): one chain of FMAs per row waited on itself.
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g0 = 0, gi = 0; g0 < k; g0 += group, ++gi) {
    const __m256 s = _mm256_set1_ps(static_cast<float>(scales[gi]));
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
      dots[r] += part * static_cast<float>(scales[gi]);
    }
#endif
}

// R rows of x (float) times output rows [begin, end) of the int8 weights; `groups` = 0: one
// scale per row, else a scale per k / groups inputs.
template <typename T, int R, typename S>
void int8_rows_block(T* op, int64_t n, const float* xf, int64_t k, const int8_t* qp,
                     const S* sp, int64_t groups, int64_t begin, int64_t end) {
  float dots[R];
  for (int64_t o = begin; o < end; ++o) {
    prefetch_lines(qp + o * k + kPrefetchBytes, k);  // the row kPrefetchBytes on, its scales
    if (groups) {
      prefetch_lines(sp + o * groups + kPrefetchBytes / (k / groups), groups * sizeof(S));
      int8_row_grouped<R>(qp + o * k, xf, k, k / groups, sp + o * groups, dots);
      for (int r = 0; r < R; ++r) op[r * n + o] = static_cast<T>(dots[r]);
    } else {
      int8_row<R>(qp + o * k, xf, k, dots);
      for (int r = 0; r < R; ++r) op[r * n + o] = static_cast<T>(dots[r] * static_cast<float>(sp[o]));
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

}  // namespace
