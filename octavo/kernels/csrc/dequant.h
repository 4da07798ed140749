// Packed int4 weights (octavo's layout, see int4_block in int4_gemm.h) dequantized a tile of row
// blocks at a time, for the dense GEMM of prefill chunks: a GGUF keeps no dense copy of its
// weights (octavo/model/quant/packed.py, PackedWeight.tiled_matmul). Written as plain loops the
// compiler vectorizes; a tile is small enough to stay in L2 for the GEMM that follows.
#pragma once

#include <ATen/ATen.h>

#include <ATen/Parallel.h>

// Rows [16 * first, 16 * (first + blocks)) of the weight, [16 * blocks, K] in bf16 or float32:
// w = (q - 8) * scale + zero, with float32 scale and zero, or float16 scale and low (zero =
// 8 * scale + low, as the int4 kernel makes it); q has a fifth bit where `high` is given.
inline at::Tensor int4_dequantize(const at::Tensor& q4, const at::Tensor& sz,
                                  const std::optional<at::Tensor>& high, int64_t first,
                                  int64_t blocks, bool bf16) {
  const at::ScalarType dtype = bf16 ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(q4.dim() == 3 && q4.size(2) == 32 && q4.scalar_type() == at::kByte &&
              q4.is_contiguous(), "int4_dequantize: codes must be [N / 16, K / 4, 32] uint8");
  TORCH_CHECK(first >= 0 && blocks >= 0 && first + blocks <= q4.size(0),
              "int4_dequantize: row blocks out of range");
  const int64_t k = q4.size(1) * 4, groups = k / 32;
  const bool half_scales = sz.scalar_type() == at::kHalf;
  TORCH_CHECK((half_scales || sz.scalar_type() == at::kFloat) && sz.is_contiguous() &&
              sz.numel() == q4.size(0) * groups * 32,
              "int4_dequantize: scales must be [N/16, K/32, 2, 16] float32 or float16");
  TORCH_CHECK(!high || (high->scalar_type() == at::kInt && high->is_contiguous() &&
                        high->numel() == q4.size(0) * (k / 4) * 2),
              "int4_dequantize: fifth bits must be [N / 16, K / 4, 2] int32");
  auto out = at::empty({blocks * 16, k}, at::dtype(dtype));
  const uint8_t* qp = q4.data_ptr<uint8_t>() + first * k * 8;
  const uint32_t* hp =
      high ? reinterpret_cast<const uint32_t*>(high->data_ptr<int32_t>()) + first * (k / 4) * 2
           : nullptr;
  auto run = [&](const auto* sp, auto* op) {
    using out_t = std::remove_pointer_t<decltype(op)>;
    sp += first * groups * 32;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      float w[16][32];  // one group of 32 inputs for the block's 16 rows
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t g = 0; g < groups; ++g) {
          const auto* s = sp + (b * groups + g) * 32;  // 16 scales, then 16 zeros (or lows)
          const uint8_t* codes = qp + (b * (k / 4) + g * 8) * 32;
          const uint32_t* fifth = hp ? hp + (b * (k / 4) + g * 8) * 2 : nullptr;
          for (int r = 0; r < 16; ++r) {
            const float scale = static_cast<float>(s[r]);
            const float zero = half_scales ? 8.f * scale + static_cast<float>(s[16 + r])
                                           : static_cast<float>(s[16 + r]);
            for (int c = 0; c < 8; ++c)
              for (int j = 0; j < 2; ++j) {
                const int lane = 2 * r + j;
                const uint8_t byte = codes[c * 32 + lane];
                const int lo_high = fifth ? ((fifth[2 * c] >> lane) & 1) << 4 : 0;
                const int hi_high = fifth ? ((fifth[2 * c + 1] >> lane) & 1) << 4 : 0;
                w[r][4 * c + j] = (static_cast<float>((byte & 15) | lo_high) - 8.f) * scale + zero;
                w[r][4 * c + 2 + j] = (static_cast<float>((byte >> 4) | hi_high) - 8.f) * scale + zero;
              }
          }
          for (int r = 0; r < 16; ++r) {
            out_t* row = op + (b * 16 + r) * k + g * 32;
            for (int i = 0; i < 32; ++i) row[i] = static_cast<out_t>(w[r][i]);
          }
        }
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
