// Low-bit weights times many rows of float32 activations on AVX2: each block of 16 output rows
// is dequantized once into a float32 panel, then every row of x is multiplied with it by an FMA
// micro-kernel. Int4 codes in octavo's layout (int4_gemm.h) and grouped int8 codes
// (int8_gemm.h) fill panels; one driver multiplies them. Included by cpu_ops.cpp only, after
// dequant.h.
//
// Why: the streaming kernels (int4_block_f32, int8_row_grouped) unpack the codes again for
// every few rows of x, so past a few rows their unpacking costs as much as their FMAs; the
// tiles (int4_tiled_linear, int8_tiled_linear) pay for a scalar dequantization and a GEMM call
// per tile. Here the unpacking is paid once per weight whatever the rows, and the FMAs read the
// panel from L1 or L2.
#pragma once

#include "dequant.h"
#include "streaming.h"

namespace {

#if defined(__AVX2__) && defined(__FMA__)
// One group (32 inputs) of a row block's 16 rows in float32, written transposed into a panel:
// input i's 16 values go to panel[i * 16, +16). A lane is a row (8 per half): widened to 32
// bits, a row's two bytes of quad c hold its codes for inputs 4c, 4c + 2, 4c + 1, 4c + 3 at bits
// 0, 4, 8 and 12. As in int4_block_f32, each code is masked in place and converts to q * 16^i,
// and the scale comes prescaled by 16^-i (exact), so a weight costs one AND, one conversion and
// one FMA: w = q * scale + offset (offset = low, or zero - 8 * scale). The FMA rounds once where
// int4_dequantize rounds twice; the product is a float32 GEMM's either way.
template <typename S>
inline void int4_group_panel(const uint8_t* codes, const uint32_t* fifth, const uint8_t* nibbles,
                             const S* s, float* panel) {
  constexpr int kInput[4] = {0, 2, 1, 3};
  constexpr float kPlace[4] = {1.f, 1.f / 16, 1.f / 256, 1.f / 4096};
  const __m256i one = _mm256_set1_epi32(1);
  // Lane l of half h is row 8h + l: its fifth bits are bits 2 (8h + l) + j of a word.
  const __m256i row_bit[2] = {_mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14),
                              _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30)};
  for (int h = 0; h < 2; ++h) {
    __m256 scale, offset;
    if constexpr (std::is_same_v<S, float>) {
      scale = _mm256_loadu_ps(s + 8 * h);
      offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), scale, _mm256_loadu_ps(s + 16 + 8 * h));
    } else {  // float16 scale and low: w = scale * q + low
      scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 8 * h)));
      offset = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16 + 8 * h)));
    }
    __m256 placed[4];
    for (int i = 0; i < 4; ++i) placed[i] = _mm256_mul_ps(scale, _mm256_set1_ps(kPlace[i]));
    for (int c = 0; c < 8; ++c) {
      const __m256i v = _mm256_cvtepu16_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + c * 32 + h * 16)));
      __m256i u = _mm256_setzero_si256();
      if (nibbles != nullptr)
        u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(nibbles + c * 32 + h * 16))),
                              4);
      for (int i = 0; i < 4; ++i) {
        const __m256i mask = _mm256_set1_epi32(0xF << (4 * i));
        __m256i code = _mm256_and_si256(v, mask);
        if (nibbles != nullptr)  // the high nibble above the low one: 16 q_high 16^i
          code = _mm256_or_si256(code, _mm256_and_si256(u, _mm256_slli_epi32(mask, 4)));
        if (fifth != nullptr) {  // the low nibbles' word for i = 0, 2; bit 2r + i / 2
          const __m256i word = _mm256_set1_epi32(static_cast<int>(fifth[2 * c + (i & 1)]));
          const __m256i shift = _mm256_add_epi32(row_bit[h], _mm256_set1_epi32(i >> 1));
          const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(word, shift), one);
          code = _mm256_or_si256(code, _mm256_slli_epi32(bit, 4 * i + 4));
        }
        _mm256_storeu_ps(panel + (4 * c + kInput[i]) * 16 + 8 * h,
                         _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), placed[i], offset));
      }
    }
  }
}

// Rows of x (R of them, x_stride apart) times a panel [k, 16] -> out (out_stride apart), added
// to what out holds when `accumulate`. 2R sums in registers: 6 rows keep 12 FMA chains in
// flight, enough for two FMA pipes of 4-5 cycles' latency.
template <int R>
inline void panel_rows(const float* panel, int64_t k, const float* x, int64_t x_stride,
                       float* out, int64_t out_stride, bool accumulate) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      acc[r][h] = accumulate ? _mm256_loadu_ps(out + r * out_stride + 8 * h) : _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = _mm256_loadu_ps(panel + i * 16), w1 = _mm256_loadu_ps(panel + i * 16 + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + i);
      acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * out_stride + 8 * h, acc[r][h]);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Codes -> float32 for 8 inputs of 8 rows (each 8 int8 codes at `codes + r * stride` times its
// row's scale), transposed into panel[i * 16 + r] for input i.
inline void int8_panel_8x8(const int8_t* codes, int64_t stride, const float* scales,
                           float* panel) {
  __m256 v[8];
  for (int r = 0; r < 8; ++r)
    v[r] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                             reinterpret_cast<const __m128i*>(codes + r * stride)))),
                         _mm256_set1_ps(scales[r]));
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      u[4 * i + 2 * j] = _mm256_shuffle_ps(t[4 * i + j], t[4 * i + 2 + j], 0x44);
      u[4 * i + 2 * j + 1] = _mm256_shuffle_ps(t[4 * i + j], t[4 * i + 2 + j], 0xEE);
    }
  // u[4i + c] holds rows 4i..4i+3 of inputs c and c + 4 (in its two 128-bit halves)
  for (int c = 0; c < 4; ++c) {
    _mm256_store_ps(panel + c * 16, _mm256_permute2f128_ps(u[c], u[4 + c], 0x20));
    _mm256_store_ps(panel + (c + 4) * 16, _mm256_permute2f128_ps(u[c], u[4 + c], 0x31));
  }
}
#endif

// Inputs a panel holds at once: 64 KB of float32, so that it stays in L1/L2 beside the rows of
// x it meets, whatever K.
constexpr int64_t kPanelInputs = 1024;
constexpr int kPanelRows = 5;  // rows of x per micro-kernel call: 10 sums, 2 weights, 1 input

// x [M, K] float32 (rows of K) times a weight of `blocks` blocks of 16 output rows -> out [M, n]
// (n <= 16 * blocks: a last, partial block is cut). fill(b, first, inputs, panel) writes
// panel[i * 16 + r] = row 16b + r's weight for input first + i (i < inputs; int4 fills groups
// of 32 inputs, int8 ones runs of 8).
template <typename Fill>
void panel_gemm(const float* x, int64_t rows, int64_t k, int64_t blocks, float* out, int64_t n,
                Fill&& fill) {
#if defined(__AVX2__) && defined(__FMA__)
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    // A panel row of 16 floats is one cache line when the panel starts on one: neither of its
    // two loads then splits across lines.
    std::vector<float> buffer(std::min(kPanelInputs, k) * 16 + 16);
    float* panel = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
    std::vector<float> tail;  // a partial last block's outputs, 16 a row
    for (int64_t b = begin; b < end; ++b) {
      const bool partial = 16 * b + 16 > n;
      if (partial) tail.resize(rows * 16);
      float* ob = partial ? tail.data() : out + b * 16;
      const int64_t ob_stride = partial ? 16 : n;
      for (int64_t first = 0; first < k; first += kPanelInputs) {
        const int64_t inputs = std::min(kPanelInputs, k - first);
        fill(b, first, inputs, panel);
        for (int64_t r = 0; r < rows; r += kPanelRows)
          for_rows(std::min<int64_t>(kPanelRows, rows - r), [&](auto m) {
            if constexpr (decltype(m)::value <= kPanelRows)
              panel_rows<decltype(m)::value>(panel, inputs, x + r * k + first, k,
                                             ob + r * ob_stride, ob_stride, first > 0);
          });
      }
      if (partial)
        for (int64_t r = 0; r < rows; ++r)
          std::copy(ob + r * 16, ob + r * 16 + (n - 16 * b), out + r * n + 16 * b);
    }
  });
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kPanelGemm = true;
#else
constexpr bool kPanelGemm = false;
#endif

}  // namespace

// x [M, K] float32 times the weight (Int4Weight) -> [M, N padded to 16] float32, each row block
// dequantized once per kPanelInputs inputs into a panel and multiplied with every row of x.
inline at::Tensor int4_panel_gemm_f32(const at::Tensor& x, const at::Tensor& q4,
                                      const at::Tensor& sz, const std::optional<at::Tensor>& high) {
  TORCH_CHECK(kPanelGemm, "int4_panel_gemm_f32 needs AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat &&
              x.size(1) == q4.size(1) * 4, "int4_panel_gemm_f32: x must be a contiguous [M, K] "
              "float32 tensor with the weight's K");
  const Int4Weight w("int4_panel_gemm_f32", q4, sz, high);
  const int64_t rows = x.size(0), n = w.blocks * 16;
  auto out = at::empty({rows, n}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  auto run = [&](const auto* scale_type) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(scale_type)>>;
    panel_gemm(x.data_ptr<float>(), rows, w.k, w.blocks, out.data_ptr<float>(), n,
               [&](int64_t b, int64_t first, int64_t inputs, float* panel) {
                 for (int64_t g = first / 32; g < (first + inputs) / 32; ++g)
                   int4_group_panel(w.group_codes(b, g), w.group_fifth(b, g),
                                    w.group_nibbles(b, g), w.group_scales<S>(b, g),
                                    panel + (g * 32 - first) * 16);
               });
  };
  if (w.half_scales)
    run(static_cast<const at::Half*>(nullptr));
  else
    run(static_cast<const float*>(nullptr));
#endif
  return out;
}

// x [M, K] float32 times int8 codes q [N, K] with a scale per row ([N]) or per group of a
// multiple of 16 inputs ([N, G]), float32 or float16 -> [M, N] float32, through panels.
inline at::Tensor int8_panel_gemm_f32(const at::Tensor& x, const at::Tensor& q,
                                      const at::Tensor& scale) {
  TORCH_CHECK(kPanelGemm, "int8_panel_gemm_f32 needs AVX2 and FMA");
  const int64_t rows = x.size(0), n = q.size(0), k = q.size(1);
  const int64_t groups = scale.dim() == 2 ? scale.size(1) : 1, group = k / groups;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && group % 8 == 0,
              "int8_panel_gemm_f32: contiguous float32 x, groups of a multiple of 8 inputs");
  auto out = at::empty({rows, n}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  const int8_t* qp = q.data_ptr<int8_t>();
  auto run = [&](const auto* sp) {
    panel_gemm(x.data_ptr<float>(), rows, k, (n + 15) / 16, out.data_ptr<float>(), n,
               [&](int64_t b, int64_t first, int64_t inputs, float* panel) {
                 for (int h = 0; h < 2; ++h) {
                   // Rows past N (a partial last block) repeat the last row; their outputs are
                   // cut.
                   const int64_t r0 = 16 * b + 8 * h;
                   int64_t row[8];
                   for (int r = 0; r < 8; ++r) row[r] = std::min(r0 + r, n - 1);
                   for (int64_t i = 0; i < inputs; i += 8) {
                     const int64_t g = (first + i) / group;
                     float s[8];
                     for (int r = 0; r < 8; ++r)
                       s[r] = static_cast<float>(sp[row[r] * groups + g]);
                     if (r0 + 8 <= n) {
                       int8_panel_8x8(qp + r0 * k + first + i, k, s, panel + i * 16 + 8 * h);
                       continue;
                     }
                     for (int64_t j = 0; j < 8; ++j)
                       for (int r = 0; r < 8; ++r)
                         panel[(i + j) * 16 + 8 * h + r] =
                             static_cast<float>(qp[row[r] * k + first + i + j]) * s[r];
                   }
                 }
               });
  };
  if (scale.scalar_type() == at::kHalf)
    run(scale.data_ptr<at::Half>());
  else
    run(scale.data_ptr<float>());
#endif
  return out;
}
