// Packed int4 weights (octavo's layout, see int4_block in int4_gemm.h) dequantized a tile of row
// blocks at a time, for the dense GEMM of prefill chunks: a GGUF keeps no dense copy of its
// weights (octavo/model/quant/packed.py, PackedWeight.tiled_matmul). A tile is small enough to
// stay in L2 for the GEMM that follows.
#pragma once

#include "simd.h"

namespace {

#if defined(__AVX512BW__)
// One group (32 inputs) of a row block's 16 rows, written transposed: input i's 16 values go to
// out[i * ld, +16). Byte 2r + j of quad c holds row r's codes for inputs 4c + j (low nibble)
// and 4c + 2 + j (high): widened to 32 lanes, even lanes are j = 0 and odd ones j = 1, so one
// permutation of each nibble's lanes gives two inputs' 16 rows, which meet the rows' scales.
// `fifth` / `nibbles`: the group's fifth bits or high nibbles (int4_gemm.h), or null.
template <typename S, typename out_t>
inline void int4_group_transposed(const uint8_t* codes, const uint32_t* fifth,
                                  const uint8_t* nibbles, const S* s, out_t* out, int64_t ld) {
  __m512 scale, zero;
  if constexpr (std::is_same_v<S, float>) {
    scale = _mm512_loadu_ps(s);
    zero = _mm512_loadu_ps(s + 16);
  } else {  // float16 scale and low: zero = 8 * scale + low, as the int4 kernel makes it
    scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
    zero = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(8.f), scale),
                         _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16))));
  }
  const __m512i nibble = _mm512_set1_epi16(15), sixteen = _mm512_set1_epi16(16);
  const __m512i by_input = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5,
                                            3, 1, 30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8,
                                            6, 4, 2, 0);
  const __m512 eight = _mm512_set1_ps(8.f);
  for (int c = 0; c < 8; ++c) {
    const __m512i w = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + c * 32)));
    __m512i q[2] = {_mm512_and_si512(w, nibble), _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble)};
    if (nibbles != nullptr) {  // q += 16 * the high nibble
      const __m512i u = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + c * 32)));
      q[0] = _mm512_add_epi16(q[0], _mm512_slli_epi16(_mm512_and_si512(u, nibble), 4));
      q[1] = _mm512_add_epi16(q[1], _mm512_and_si512(u, _mm512_set1_epi16(0xF0)));
    }
    for (int h = 0; h < 2; ++h) {
      if (fifth != nullptr)
        q[h] = _mm512_mask_add_epi16(q[h], _cvtu32_mask32(fifth[2 * c + h]), q[h], sixteen);
      q[h] = _mm512_permutexvar_epi16(by_input, q[h]);
      for (int j = 0; j < 2; ++j) {  // input 4c + 2h + j
        const __m512 code = _mm512_cvtepi32_ps(
            _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(q[h], j)));
        const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(code, eight), scale), zero);
        store16(out + (4 * c + 2 * h + j) * ld, v);
      }
    }
  }
}
#endif

// The same without AVX-512.
template <typename S, typename out_t>
inline void int4_group_transposed_scalar(const uint8_t* codes, const uint32_t* fifth,
                                         const uint8_t* nibbles, const S* s, bool half_scales,
                                         out_t* out, int64_t ld) {
  for (int r = 0; r < 16; ++r) {
    const float scale = static_cast<float>(s[r]);
    const float zero = half_scales ? 8.f * scale + static_cast<float>(s[16 + r])
                                   : static_cast<float>(s[16 + r]);
    for (int c = 0; c < 8; ++c)
      for (int j = 0; j < 2; ++j) {
        const int lane = 2 * r + j;
        const uint8_t byte = codes[c * 32 + lane];
        int lo_high = fifth ? ((fifth[2 * c] >> lane) & 1) << 4 : 0;
        int hi_high = fifth ? ((fifth[2 * c + 1] >> lane) & 1) << 4 : 0;
        if (nibbles != nullptr) {
          lo_high = (nibbles[c * 32 + lane] & 15) << 4;
          hi_high = nibbles[c * 32 + lane] & 0xF0;
        }
        const float lo = static_cast<float>((byte & 15) | lo_high) - 8.f;
        const float hi = static_cast<float>((byte >> 4) | hi_high) - 8.f;
        out[(4 * c + j) * ld + r] = static_cast<out_t>(lo * scale + zero);
        out[(4 * c + 2 + j) * ld + r] = static_cast<out_t>(hi * scale + zero);
      }
  }
}

}  // namespace

// Rows [16 * first, 16 * (first + blocks)) of the weight, [16 * blocks, K] in bf16 or float32:
// w = (q - 8) * scale + zero, with float32 scale and zero, or float16 scale and low (zero =
// 8 * scale + low, as the int4 kernel makes it); q has a fifth bit or a high nibble where
// `high` (fifth bits int32, or high nibbles uint8: int4_gemm.h) is given. The
// result is the transpose of a contiguous [K, 16 * blocks]: a row block's 16 rows of one input
// are adjacent in the codes, so they are written together, and the GEMM takes either layout.
inline at::Tensor int4_dequantize(const at::Tensor& q4, const at::Tensor& sz,
                                  const std::optional<at::Tensor>& high, int64_t first,
                                  int64_t blocks, bool bf16) {
  const at::ScalarType dtype = bf16 ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(q4.dim() == 3 && q4.size(2) == 32 && q4.scalar_type() == at::kByte &&
              q4.is_contiguous(), "int4_dequantize: codes must be [N / 16, K / 4, 32] uint8");
  TORCH_CHECK(first >= 0 && blocks >= 0 && first + blocks <= q4.size(0),
              "int4_dequantize: row blocks out of range");
  const int64_t k = q4.size(1) * 4, groups = k / 32, ld = blocks * 16;
  const bool half_scales = sz.scalar_type() == at::kHalf;
  TORCH_CHECK((half_scales || sz.scalar_type() == at::kFloat) && sz.is_contiguous() &&
              sz.numel() == q4.size(0) * groups * 32,
              "int4_dequantize: scales must be [N/16, K/32, 2, 16] float32 or float16");
  TORCH_CHECK(!high || (high->is_contiguous() &&
                        ((high->scalar_type() == at::kInt &&
                          high->numel() == q4.size(0) * (k / 4) * 2) ||
                         (high->scalar_type() == at::kByte && high->numel() == q4.numel()))),
              "int4_dequantize: the high plane must be fifth bits [N / 16, K / 4, 2] int32 or "
              "high nibbles [N / 16, K / 4, 32] uint8");
  auto out = at::empty({k, ld}, at::dtype(dtype));
  const uint8_t* qp = q4.data_ptr<uint8_t>() + first * k * 8;
  const bool nibble_plane = high && high->scalar_type() == at::kByte;
  const uint32_t* hp = high && !nibble_plane
                           ? reinterpret_cast<const uint32_t*>(high->data_ptr<int32_t>()) +
                                 first * (k / 4) * 2
                           : nullptr;
  const uint8_t* np = nibble_plane ? high->data_ptr<uint8_t>() + first * k * 8 : nullptr;
  auto run = [&](const auto* sp, auto* op) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(sp)>>;
    sp += first * groups * 32;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* codes = qp + (b * (k / 4) + g * 8) * 32;
          const uint32_t* fifth = hp ? hp + (b * (k / 4) + g * 8) * 2 : nullptr;
          const uint8_t* nibbles = np ? np + (b * (k / 4) + g * 8) * 32 : nullptr;
          const S* s = sp + (b * groups + g) * 32;  // 16 scales, then 16 zeros (or lows)
          auto* dst = op + g * 32 * ld + b * 16;
#if defined(__AVX512BW__)
          int4_group_transposed(codes, fifth, nibbles, s, dst, ld);
#else
          int4_group_transposed_scalar(codes, fifth, nibbles, s, half_scales, dst, ld);
#endif
        }
    });
  };
  if (dtype == at::kFloat) {
    if (half_scales) run(sz.data_ptr<at::Half>(), out.data_ptr<float>());
    else run(sz.data_ptr<float>(), out.data_ptr<float>());
  } else {
    if (half_scales) run(sz.data_ptr<at::Half>(), out.data_ptr<c10::BFloat16>());
    else run(sz.data_ptr<float>(), out.data_ptr<c10::BFloat16>());
  }
  return out.t();
}

// x [M, K] (bf16 or float32) times a low-bit weight of `units` units of `unit_rows` rows ->
// [M, units * unit_rows], for batches where the dense GEMM beats the low-bit kernels (prefill
// chunks): `dequantize(first, count)` gives units [first, first + count) as dense rows [count *
// unit_rows, K] in x's dtype, a tile of about a million weights (4 MB in float32: L2-sized) at a
// time, each tile one GEMM written in place into the output.
template <typename F>
at::Tensor tiled_linear(const at::Tensor& x, int64_t units, int64_t unit_rows, F&& dequantize) {
  const int64_t k = x.size(1);
  const int64_t per_tile = std::max<int64_t>(64 / unit_rows, (int64_t{1} << 20) / (unit_rows * k));
  auto out = at::empty({x.size(0), units * unit_rows}, x.options());
  for (int64_t first = 0; first < units; first += per_tile) {
    const int64_t count = std::min(per_tile, units - first);
    auto part = out.narrow(1, first * unit_rows, count * unit_rows);  // BLAS's ldc
    at::mm_out(part, x, dequantize(first, count).t());
  }
  return out;
}

// x [M, K] times int4 weights in octavo's layout -> [M, N padded to 16], tile by tile.
inline at::Tensor int4_tiled_linear(const at::Tensor& x, const at::Tensor& q4,
                                    const at::Tensor& sz, const std::optional<at::Tensor>& high) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == q4.size(1) * 4 &&
              (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "int4_tiled_linear: x must be [M, K] bf16 or float32 with the weight's K");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  return tiled_linear(x, q4.size(0), 16, [&](int64_t first, int64_t blocks) {
    return int4_dequantize(q4, sz, high, first, blocks, bf16);
  });
}
