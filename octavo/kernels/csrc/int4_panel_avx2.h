// Int4 weights in octavo's layout (int4_gemm.h) times many rows of float32 activations on AVX2:
// each row block is dequantized once into a float32 panel, then every row of x is multiplied
// with it by an FMA micro-kernel. Included by cpu_ops.cpp only, after dequant.h.
//
// Why: the streaming kernel (int4_block_f32) unpacks the codes again for every 4 rows of x, so
// its unpacking costs as much as its FMAs and past a few rows it runs at half the FMA rate;
// the tiles (int4_tiled_linear) pay for a scalar dequantization and a GEMM call per tile. Here
// the unpacking is paid once per weight whatever the rows, and the FMAs read the panel from L1
// or L2.
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

// Inputs a panel holds at once: 64 KB of float32, so that it stays in L1/L2 beside the rows of
// x it meets, whatever K.
constexpr int64_t kPanelInputs = 1024;
constexpr int kPanelRows = 5;  // rows of x per micro-kernel call

}  // namespace

bool built_with_avx2_panel() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

// x [M, K] float32 times the weight (Int4Weight) -> [M, N padded to 16] float32, each row block
// dequantized once per kPanelInputs inputs into a panel and multiplied with every row of x.
inline at::Tensor int4_panel_gemm_f32(const at::Tensor& x, const at::Tensor& q4,
                                      const at::Tensor& sz, const std::optional<at::Tensor>& high) {
  TORCH_CHECK(built_with_avx2_panel(), "int4_panel_gemm_f32 needs AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat &&
              x.size(1) == q4.size(1) * 4, "int4_panel_gemm_f32: x must be a contiguous [M, K] "
              "float32 tensor with the weight's K");
  const Int4Weight w("int4_panel_gemm_f32", q4, sz, high);
  const int64_t rows = x.size(0), n = w.blocks * 16;
  auto out = at::empty({rows, n}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto run = [&](const auto* scale_type) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(scale_type)>>;
    at::parallel_for(0, w.blocks, 1, [&](int64_t begin, int64_t end) {
      // A panel row of 16 floats is one cache line when the panel starts on one: neither of
      // its two loads then splits across lines.
      std::vector<float> buffer(std::min(kPanelInputs, w.k) * 16 + 16);
      float* panel = reinterpret_cast<float*>(
          (reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
      for (int64_t b = begin; b < end; ++b)
        for (int64_t first = 0; first < w.k; first += kPanelInputs) {
          const int64_t inputs = std::min(kPanelInputs, w.k - first);
          for (int64_t g = 0; g < inputs / 32; ++g) {
            const int64_t group = first / 32 + g;
            int4_group_panel(w.group_codes(b, group), w.group_fifth(b, group),
                             w.group_nibbles(b, group), w.group_scales<S>(b, group),
                             panel + g * 32 * 16);
          }
          for (int64_t r = 0; r < rows; r += kPanelRows)
            for_rows(std::min<int64_t>(kPanelRows, rows - r), [&](auto m) {
              panel_rows<decltype(m)::value>(panel, inputs, xp + r * w.k + first, w.k,
                                             op + r * n + b * 16, n, first > 0);
            });
        }
    });
  };
  if (w.half_scales)
    run(static_cast<const at::Half*>(nullptr));
  else
    run(static_cast<const float*>(nullptr));
#endif
  return out;
}
