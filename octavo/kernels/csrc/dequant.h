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

// Row r of one group (32 inputs) of a row block: input i's value goes to out[i * stride].
// `fifth` / `nibbles` as above. Compiled without contracting a product and a sum into one FMA,
// so that the values equal the AVX-512 path's and the Python reference's bit for bit.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename S, typename out_t>
inline void int4_row_group(const uint8_t* codes, const uint32_t* fifth, const uint8_t* nibbles,
                           const S* s, bool half_scales, int r, out_t* out, int64_t stride) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
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
      out[(4 * c + j) * stride] = static_cast<out_t>(lo * scale + zero);
      out[(4 * c + 2 + j) * stride] = static_cast<out_t>(hi * scale + zero);
    }
}
#pragma GCC pop_options

// int4_group_transposed without AVX-512.
template <typename S, typename out_t>
inline void int4_group_transposed_scalar(const uint8_t* codes, const uint32_t* fifth,
                                         const uint8_t* nibbles, const S* s, bool half_scales,
                                         out_t* out, int64_t ld) {
  for (int r = 0; r < 16; ++r) int4_row_group(codes, fifth, nibbles, s, half_scales, r, out + r, ld);
}

// A weight in octavo's int4 layout (int4_gemm.h), its arguments checked: codes [N / 16, K / 4,
// 32] uint8; scales [N / 16, K / 32, 2, 16], float32 scale and zero or float16 scale and low
// (zero = 8 * scale + low, as the int4 kernel makes it); an optional high plane, fifth bits
// [N / 16, K / 4, 2] int32 or high nibbles shaped like the codes. Addressed by row block and
// group of 32 inputs.
struct Int4Weight {
  const uint8_t* codes;
  const uint32_t* fifth = nullptr;
  const uint8_t* nibbles = nullptr;
  const void* scales;
  bool half_scales;
  int64_t k, groups, blocks;

  Int4Weight(const char* op, const at::Tensor& q4, const at::Tensor& sz,
             const std::optional<at::Tensor>& high) {
    TORCH_CHECK(q4.dim() == 3 && q4.size(2) == 32 && q4.scalar_type() == at::kByte &&
                q4.is_contiguous(), op, ": codes must be [N / 16, K / 4, 32] uint8");
    k = q4.size(1) * 4, groups = k / 32, blocks = q4.size(0);
    half_scales = sz.scalar_type() == at::kHalf;
    TORCH_CHECK((half_scales || sz.scalar_type() == at::kFloat) && sz.is_contiguous() &&
                sz.numel() == blocks * groups * 32,
                op, ": scales must be [N/16, K/32, 2, 16] float32 or float16");
    TORCH_CHECK(!high || (high->is_contiguous() &&
                          ((high->scalar_type() == at::kInt &&
                            high->numel() == blocks * (k / 4) * 2) ||
                           (high->scalar_type() == at::kByte && high->numel() == q4.numel()))),
                op, ": the high plane must be fifth bits [N / 16, K / 4, 2] int32 or high "
                "nibbles [N / 16, K / 4, 32] uint8");
    codes = q4.data_ptr<uint8_t>();
    scales = sz.data_ptr();
    if (high && high->scalar_type() == at::kByte) nibbles = high->data_ptr<uint8_t>();
    else if (high) fifth = reinterpret_cast<const uint32_t*>(high->data_ptr<int32_t>());
  }

  int64_t quad(int64_t b, int64_t g) const { return b * (k / 4) + g * 8; }
  const uint8_t* group_codes(int64_t b, int64_t g) const { return codes + quad(b, g) * 32; }
  const uint32_t* group_fifth(int64_t b, int64_t g) const {
    return fifth ? fifth + quad(b, g) * 2 : nullptr;
  }
  const uint8_t* group_nibbles(int64_t b, int64_t g) const {
    return nibbles ? nibbles + quad(b, g) * 32 : nullptr;
  }
  template <typename S>
  const S* group_scales(int64_t b, int64_t g) const {  // 16 scales, then 16 zeros (or lows)
    return static_cast<const S*>(scales) + (b * groups + g) * 32;
  }

  // Runs body(scales pointer type tag, output pointer) for the scales' type and the dtype.
  template <typename F>
  void dispatch(at::Tensor& out, F&& body) const {
    if (out.scalar_type() == at::kFloat) {
      if (half_scales) body(static_cast<const at::Half*>(nullptr), out.data_ptr<float>());
      else body(static_cast<const float*>(nullptr), out.data_ptr<float>());
    } else {
      if (half_scales) body(static_cast<const at::Half*>(nullptr), out.data_ptr<c10::BFloat16>());
      else body(static_cast<const float*>(nullptr), out.data_ptr<c10::BFloat16>());
    }
  }
};

}  // namespace

// Rows [16 * first, 16 * (first + blocks)) of the weight (Int4Weight), [16 * blocks, K] in bf16
// or float32: w = (q - 8) * scale + zero. The result is the transpose of a contiguous
// [K, 16 * blocks]: a row block's 16 rows of one input are adjacent in the codes, so they are
// written together, and the GEMM takes either layout.
inline at::Tensor int4_dequantize(const at::Tensor& q4, const at::Tensor& sz,
                                  const std::optional<at::Tensor>& high, int64_t first,
                                  int64_t blocks, bool bf16) {
  const Int4Weight w("int4_dequantize", q4, sz, high);
  TORCH_CHECK(first >= 0 && blocks >= 0 && first + blocks <= w.blocks,
              "int4_dequantize: row blocks out of range");
  const int64_t ld = blocks * 16;
  auto out = at::empty({w.k, ld}, at::dtype(bf16 ? at::kBFloat16 : at::kFloat));
  w.dispatch(out, [&](auto scale_type, auto* op) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(scale_type)>>;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        for (int64_t g = 0; g < w.groups; ++g) {
          auto* dst = op + g * 32 * ld + b * 16;
#if defined(__AVX512BW__)
          int4_group_transposed(w.group_codes(first + b, g), w.group_fifth(first + b, g),
                                w.group_nibbles(first + b, g), w.group_scales<S>(first + b, g),
                                dst, ld);
#else
          int4_group_transposed_scalar(w.group_codes(first + b, g), w.group_fifth(first + b, g),
                                       w.group_nibbles(first + b, g),
                                       w.group_scales<S>(first + b, g), w.half_scales, dst, ld);
#endif
        }
    });
  });
  return out.t();
}

// Rows `ids` [T] int64 of the weight (an embedding's lookups), [T, K] in bf16 or float32,
// valued as int4_dequantize values them.
inline at::Tensor int4_rows(const at::Tensor& q4, const at::Tensor& sz,
                            const std::optional<at::Tensor>& high, const at::Tensor& ids,
                            bool bf16) {
  const Int4Weight w("int4_rows", q4, sz, high);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "int4_rows: ids must be [T] int64");
  const at::Tensor row_ids = ids.contiguous();
  const int64_t* ip = row_ids.data_ptr<int64_t>();
  const int64_t t = row_ids.size(0);
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < w.blocks * 16, "int4_rows: row ", ip[i], " is outside [0, ",
                w.blocks * 16, ")");
  auto out = at::empty({t, w.k}, at::dtype(bf16 ? at::kBFloat16 : at::kFloat));
  w.dispatch(out, [&](auto scale_type, auto* op) {
    using S = std::remove_const_t<std::remove_pointer_t<decltype(scale_type)>>;
    at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = ip[i] / 16;
        const int r = static_cast<int>(ip[i] % 16);
        for (int64_t g = 0; g < w.groups; ++g)
          int4_row_group(w.group_codes(b, g), w.group_fifth(b, g), w.group_nibbles(b, g),
                         w.group_scales<S>(b, g), w.half_scales, r, op + i * w.k + g * 32, 1);
      }
    });
  });
  return out;
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
at::Tensor int4_tiled_linear(const at::Tensor& x, const at::Tensor& q4,
                             const at::Tensor& sz, const std::optional<at::Tensor>& high) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == q4.size(1) * 4 &&
              (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "int4_tiled_linear: x must be [M, K] bf16 or float32 with the weight's K");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  return tiled_linear(x, q4.size(0), 16, [&](int64_t first, int64_t blocks) {
    return int4_dequantize(q4, sz, high, first, blocks, bf16);
  });
}
