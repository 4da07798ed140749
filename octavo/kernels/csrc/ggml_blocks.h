// GGUF's 5- and 6-bit block types, Q5_0 and Q6_K, computed from the file's own bytes: a weight
// keeps 5.5 or 6.56 bits, where widening it to int8 codes (Int8Grouped) took 8.5 or 10.
// Each weight row is decoded into int8 codes and a float scale per group (32 inputs for Q5_0,
// 16 for Q6_K) in a buffer that stays in L1, and the grouped int8 GEMV (int8_gemm.h) runs on
// it: the same products, in the same order, as the int8 codes would give, from 0.65 or 0.62 of
// the bytes. Prefill chunks take dense tiles of the same decoded rows (dequant.h, tiled_linear).
// Included by cpu_ops.cpp only, after int8_gemm.h and dequant.h.
#pragma once

#include <c10/util/Half.h>

#include <string>

#include "dequant.h"
#include "int8_gemm.h"

// A block type by the name the Python side gives it (octavo/model/quant/packed.py, GGMLBlocks).
enum class GgmlType { kQ5_0, kQ6_K };

struct GgmlLayout {
  int64_t weights;  // per block
  int64_t bytes;    // per block
  int64_t group;    // inputs per scale
};

inline GgmlType ggml_type(const std::string& name) {
  if (name == "q5_0") return GgmlType::kQ5_0;
  if (name == "q6_k") return GgmlType::kQ6_K;
  TORCH_CHECK(false, "unknown GGML block type '", name, "' (q5_0, q6_k)");
}

inline GgmlLayout ggml_layout(GgmlType type) {
  return type == GgmlType::kQ5_0 ? GgmlLayout{32, 22, 32} : GgmlLayout{256, 210, 16};
}

namespace {

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

#if defined(__AVX2__)
// 16 bits of a Q5_0 block's qh, one per weight, as 16 bytes of 0x10 (bit set) or 0.
inline __m128i fifth_bits(uint32_t bits16) {
  const __m128i spread = _mm_shuffle_epi8(
      _mm_cvtsi32_si128(static_cast<int>(bits16)),
      _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  const __m128i select = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, select), select), _mm_set1_epi8(16));
}
#endif

// Q5_0 (ggml's block_q5_0: fp16 d, 32 high bits qh, 16 bytes of nibbles): byte j holds weights
// j (low nibble) and j + 16 (high), bit j of qh is weight j's fifth bit; w = d * (q - 16).
inline void decode_q5_0_row(const uint8_t* row, int64_t blocks, int8_t* codes, float* scales) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = row + b * 22;
    uint32_t qh;
    std::memcpy(&qh, p + 2, 4);
    scales[b] = half_to_float(p);
    int8_t* out = codes + 32 * b;
#if defined(__AVX2__)
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 6));
    const __m128i nibble = _mm_set1_epi8(15), sixteen = _mm_set1_epi8(16);
    const __m128i lo = _mm_and_si128(qs, nibble);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), nibble);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                     _mm_sub_epi8(_mm_or_si128(lo, fifth_bits(qh & 0xFFFF)), sixteen));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16),
                     _mm_sub_epi8(_mm_or_si128(hi, fifth_bits(qh >> 16)), sixteen));
#else
    for (int j = 0; j < 16; ++j) {
      out[j] = static_cast<int8_t>(((p[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16);
      out[j + 16] = static_cast<int8_t>(((p[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
#endif
  }
}

// Q6_K (ggml's block_q6_K: ql[128], qh[64], 16 int8 scales, fp16 d; 256 weights in two halves
// of 128): weight 32 i + l of half h is the low (i < 2) or high nibble of ql[64 h + 32 (i % 2)
// + l] with bits 2 i, 2 i + 1 of qh[32 h + l] above it; the 16 weights of group g take
// d * scales[g], the product in float32 (exact) as ggml makes it; w = that * (q - 32).
inline void decode_q6_k_row(const uint8_t* row, int64_t blocks, int8_t* codes, float* scales) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = row + b * 210;
    const float d = half_to_float(p + 208);
    for (int g = 0; g < 16; ++g) scales[16 * b + g] = d * static_cast<float>(static_cast<int8_t>(p[192 + g]));
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = p + 64 * h;
      const uint8_t* qh = p + 128 + 32 * h;
      int8_t* out = codes + 256 * b + 128 * h;
#if defined(__AVX2__)
      const __m128i nibble = _mm_set1_epi8(15), top = _mm_set1_epi8(0x30);
      const __m128i offset = _mm_set1_epi8(32);
      for (int l = 0; l < 32; l += 16) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + l));
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 32 + l));
        const __m128i hb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + l));
        // Shifts are per 16 bits; the masks drop what crosses from the neighbouring byte.
        const __m128i q[4] = {
            _mm_or_si128(_mm_and_si128(a, nibble), _mm_and_si128(_mm_slli_epi16(hb, 4), top)),
            _mm_or_si128(_mm_and_si128(c, nibble), _mm_and_si128(_mm_slli_epi16(hb, 2), top)),
            _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), nibble), _mm_and_si128(hb, top)),
            _mm_or_si128(_mm_and_si128(_mm_srli_epi16(c, 4), nibble),
                         _mm_and_si128(_mm_srli_epi16(hb, 2), top))};
        for (int i = 0; i < 4; ++i)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 * i + l), _mm_sub_epi8(q[i], offset));
      }
#else
      for (int l = 0; l < 32; ++l) {
        out[l] = static_cast<int8_t>(((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32);
        out[l + 32] = static_cast<int8_t>(((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32);
        out[l + 64] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        out[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
      }
#endif
    }
  }
}

// One weight row's blocks -> codes [K] and scales [K / group].
inline void decode_row(GgmlType type, const uint8_t* row, int64_t blocks, int8_t* codes,
                       float* scales) {
  if (type == GgmlType::kQ5_0) decode_q5_0_row(row, blocks, codes, scales);
  else decode_q6_k_row(row, blocks, codes, scales);
}

struct GgmlMatrix {
  GgmlType type;
  GgmlLayout layout;
  const uint8_t* data;
  int64_t n, row_bytes, blocks, k;

  GgmlMatrix(const at::Tensor& b, const std::string& name)
      : type(ggml_type(name)), layout(ggml_layout(type)) {
    TORCH_CHECK(b.dim() == 2 && b.scalar_type() == at::kByte && b.is_contiguous(),
                "GGML blocks must be [N, row bytes] uint8, contiguous");
    TORCH_CHECK(b.size(1) % layout.bytes == 0, "GGML ", name, " rows must be whole blocks of ",
                layout.bytes, " bytes, got ", b.size(1));
    data = b.data_ptr<uint8_t>();
    n = b.size(0);
    row_bytes = b.size(1);
    blocks = row_bytes / layout.bytes;
    k = blocks * layout.weights;
  }

  void decode(int64_t row, int8_t* codes, float* scales) const {
    decode_row(type, data + row * row_bytes, blocks, codes, scales);
  }
};

}  // namespace

// x [M, K] (bf16 or float32) times GGML blocks [N, row bytes] -> [M, N]: each weight row is
// read once and decoded once for every row of x (8 at a time over its codes in L1).
at::Tensor ggml_gemv(at::Tensor x, at::Tensor blocks, std::string type) {
  const GgmlMatrix w(blocks, type);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) == w.k,
              "ggml_gemv: x must be [M, ", w.k, "], contiguous");
  const int64_t rows = x.size(0), n = w.n, k = w.k;
  auto out = at::empty({rows, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "ggml_gemv", [&] {
    std::vector<float> xf;
    widen_rows<scalar_t>(x, xf);
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      std::vector<int8_t> codes(k);
      std::vector<float> scales(k / w.layout.group);
      float dots[8];
      for (int64_t o = begin; o < end; ++o) {
        prefetch_lines(w.data + o * w.row_bytes + kPrefetchBytes, w.row_bytes);
        w.decode(o, codes.data(), scales.data());
        for (int64_t c = 0; c < rows; c += 8) {
          for_rows(std::min<int64_t>(8, rows - c), [&](auto r) {
            constexpr int R = decltype(r)::value;
            int8_row_grouped<R>(codes.data(), xf.data() + c * k, k, w.layout.group,
                                scales.data(), dots);
            for (int i = 0; i < R; ++i) op[(c + i) * n + o] = static_cast<scalar_t>(dots[i]);
          });
        }
      }
    });
  });
  return out;
}

// Rows [first, first + count) of the weight, dense [count, K] in bf16 or float32: w = scale *
// code, rounded once to the output type as the int8 codes' dequantization rounds it.
at::Tensor ggml_dequantize(at::Tensor blocks, std::string type, int64_t first, int64_t count,
                           bool bf16) {
  const GgmlMatrix w(blocks, type);
  TORCH_CHECK(first >= 0 && count >= 0 && first + count <= w.n, "ggml_dequantize: rows out of range");
  auto out = at::empty({count, w.k}, at::dtype(bf16 ? at::kBFloat16 : at::kFloat));
  auto run = [&](auto* op) {
    using out_t = std::remove_pointer_t<decltype(op)>;
    at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
      std::vector<int8_t> codes(w.k);
      std::vector<float> scales(w.k / w.layout.group);
      for (int64_t r = begin; r < end; ++r) {
        w.decode(first + r, codes.data(), scales.data());
        out_t* row = op + r * w.k;
        for (int64_t i = 0; i < w.k; ++i)
          row[i] = static_cast<out_t>(static_cast<float>(codes[i]) * scales[i / w.layout.group]);
      }
    });
  };
  if (bf16) run(out.data_ptr<c10::BFloat16>());
  else run(out.data_ptr<float>());
  return out;
}

// x [M, K] times the weight for batches where the dense GEMM wins (prefill chunks).
at::Tensor ggml_tiled_linear(at::Tensor x, at::Tensor blocks, std::string type) {
  const GgmlMatrix w(blocks, type);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.k &&
              (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "ggml_tiled_linear: x must be [M, ", w.k, "] bf16 or float32");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  return tiled_linear(x, w.n, 1, [&](int64_t first, int64_t count) {
    return ggml_dequantize(blocks, type, first, count, bf16);
  });
}
