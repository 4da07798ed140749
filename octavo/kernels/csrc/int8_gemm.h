// Int8 weights (per output channel, or grouped with float32 or float16 scales) times a few rows
// of bf16 or float32 activations (decode), and its entry point int8_gemv; for larger batches,
// int8_tiled_linear (dense tiles into the GEMM).
// Included by cpu_ops.cpp only (the kernels' translation unit), so calls between these files
// inline.
#pragma once

#include "dequant.h"
#include "streaming.h"

namespace {

// Int8 weights ([N, K], a float scale per output row) times a few rows of activations
// (decode). Reading the weights is the whole cost, so each weight row is read once for all rows
// of x and widened to float in registers. (int4: int4_gemm.h.)

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
                     const S* sp, int64_t groups, int64_t begin, int64_t end, bool once) {
  float dots[R];
  for (int64_t o = begin; o < end; ++o) {
    prefetch_lines(qp + o * k + kPrefetchBytes, k, once);  // the row kPrefetchBytes on, its scales
    if (groups) {
      prefetch_lines(sp + o * groups + kPrefetchBytes / (k / groups), groups * sizeof(S), once);
      int8_row_grouped<R>(qp + o * k, xf, k, k / groups, sp + o * groups, dots);
      for (int r = 0; r < R; ++r) op[r * n + o] = static_cast<T>(dots[r]);
    } else {
      int8_row<R>(qp + o * k, xf, k, dots);
      for (int r = 0; r < R; ++r) op[r * n + o] = static_cast<T>(dots[r] * static_cast<float>(sp[o]));
    }
  }
}

constexpr int64_t kInt8PanelRows = 20;

}  // namespace

at::Tensor int8_gemv(at::Tensor x, at::Tensor q, at::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && q.is_contiguous() && scale.is_contiguous());
  TORCH_CHECK(q.scalar_type() == at::kChar &&
              (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf),
              "int8_gemv: int8 codes with float32 or float16 scales");
  TORCH_CHECK(x.size(1) == q.size(1), "int8_gemv: inner sizes differ");
  TORCH_CHECK(scale.size(0) == q.size(0) && (scale.dim() == 1 ||
              (scale.dim() == 2 && q.size(1) % scale.size(1) == 0 &&
               (q.size(1) / scale.size(1)) % 16 == 0)),
              "int8_gemv: scale must be [N] or [N, G] with groups of a multiple of 16 inputs");
  const int64_t rows = x.size(0), n = q.size(0), k = q.size(1);
  const int64_t groups = scale.dim() == 2 ? scale.size(1) : 0;
  // Past a few rows the panel (panel_gemm.h) computes float32 x: AMD EPYC Zen 2 (2 threads),
  // Qwen2.5's down projection (896 x 4,864, groups of 16) 1.38 against 1.51 ms at 16 rows,
  // 1.61 against 2.27 at 24, 25.8 against 53.8 (and the tiles' 39.0) at 512.
  if (x.scalar_type() == at::kFloat && kPanelGemm && rows >= kInt8PanelRows &&
      k % 8 == 0)
    return int8_panel_gemm_f32(x, q, scale);
  auto out = at::empty({rows, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int8_gemv", [&] {
    std::vector<float> xf;
    widen_rows<scalar_t>(x, xf);
    scalar_t* op = out.data_ptr<scalar_t>();
    // Each thread takes a block of 64 weight rows (tens of KB: they stay in L2) and runs every
    // chunk of up to 8 activation rows over it, so the weights come from memory once.
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t c = 0; c < rows; c += 8) {
        for_rows(std::min<int64_t>(8, rows - c), [&](auto r) {
          if (scale.scalar_type() == at::kHalf)
            int8_rows_block<scalar_t, decltype(r)::value>(
                op + c * n, n, xf.data() + c * k, k, q.data_ptr<int8_t>(),
                scale.data_ptr<at::Half>(), groups, begin, end, rows <= 8);
          else
            int8_rows_block<scalar_t, decltype(r)::value>(
                op + c * n, n, xf.data() + c * k, k, q.data_ptr<int8_t>(),
                scale.data_ptr<float>(), groups, begin, end, rows <= 8);
        });
      }
    });
  });
  return out;
}

// Rows [first, first + count) of grouped int8 weights (q [N, K], scale [N, G] float32 or
// float16), dense [count, K] in bf16 or float32: w = code * scale, rounded once.
inline at::Tensor int8_dequantize(const at::Tensor& q, const at::Tensor& scale, int64_t first,
                                  int64_t count, bool bf16) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() &&
              scale.dim() == 2 && scale.size(0) == q.size(0) && scale.is_contiguous() &&
              q.size(1) % scale.size(1) == 0 &&
              (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf),
              "int8_dequantize: codes [N, K] int8 with scales [N, G] float32 or float16");
  TORCH_CHECK(first >= 0 && count >= 0 && first + count <= q.size(0),
              "int8_dequantize: rows out of range");
  const int64_t k = q.size(1), groups = scale.size(1), group = k / groups;
  auto out = at::empty({count, k}, at::dtype(bf16 ? at::kBFloat16 : at::kFloat));
  auto run = [&](const auto* sp, auto* op) {
    using out_t = std::remove_pointer_t<decltype(op)>;
    const int8_t* qp = q.data_ptr<int8_t>();
    at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t g = 0; g < groups; ++g) {
          const float s = static_cast<float>(sp[(first + r) * groups + g]);
          const int8_t* codes = qp + (first + r) * k + g * group;
          out_t* dst = op + r * k + g * group;
          for (int64_t i = 0; i < group; ++i) dst[i] = static_cast<out_t>(codes[i] * s);
        }
    });
  };
  if (bf16) {
    if (scale.scalar_type() == at::kHalf) run(scale.data_ptr<at::Half>(), out.data_ptr<c10::BFloat16>());
    else run(scale.data_ptr<float>(), out.data_ptr<c10::BFloat16>());
  } else {
    if (scale.scalar_type() == at::kHalf) run(scale.data_ptr<at::Half>(), out.data_ptr<float>());
    else run(scale.data_ptr<float>(), out.data_ptr<float>());
  }
  return out;
}

// x [M, K] (bf16 or float32) times grouped int8 weights -> [M, N], tile by tile.
at::Tensor int8_tiled_linear(const at::Tensor& x, const at::Tensor& q,
                             const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == q.size(1) &&
              (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "int8_tiled_linear: x must be [M, K] bf16 or float32 with the weight's K");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  return tiled_linear(x, q.size(0), 1, [&](int64_t first, int64_t count) {
    return int8_dequantize(q, scale, first, count, bf16);
  });
}
