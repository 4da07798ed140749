// Codes in octavo's int4 layout (4, 5 or 8 bits; int4_gemm.h) times activations quantized to
// int8, with AVX-512 VNNI (with AVX2 alone: int4_int8_avx2.h): the product for batches past the
// int4 kernel's rows (prefill chunks, large decode batches), and its entry point int4_int8_gemm.
// Included by cpu_ops.cpp only, after int4_gemm.h.
#pragma once

#include "streaming.h"

// Why: on a CPU without AMX, a bf16 GEMM is bound by vdpbf16ps (32 multiply-adds an
// instruction); vpdpbusd does 64 (unsigned bytes times signed bytes, summed in fours into
// int32), and the codes are already small integers. Each row of x is quantized per group of 32
// inputs (the weights' groups), q = round(x / d) with d = max |x| / 127, so that per output row
// n and group g, with w = scale * code + offset (offset = zero - 8 * scale in torch's form, low
// in a GGUF's),
//   sum x * w ~ d * (scale * sum code * q + offset * sum q):
// the error is sum w * (x - d q), the activations' rounding times the weights themselves. (With
// the exact sum of x beside unsigned codes it would be times scale * (code - c) for a centre c,
// as large as 12 times that for Q5_0 rows held as 8-bit codes.)
// A row block's codes are unpacked once into vectors whose 32-bit lane r holds row r's four
// codes of a quad as bytes, then reused from cache by every row of x.

namespace {

struct QuantizedRows {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> d;      // [M, K / 32]: q * d approximates x
  std::vector<float> qsum;   // [M, K / 32]: the sums of q (exact integers)
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)

constexpr bool kInt4Int8Gemm = true;

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t rows, int64_t k) {
  const int64_t groups = k / 32;
  QuantizedRows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * groups),
                    std::vector<float>(rows * groups)};
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const T* xg = x + r * k + g * 32;
        const __m512 a = load16(xg), b = load16(xg + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        int8_t* qg = out.q.data() + r * k + g * 32;
        // Rounded to nearest (even on ties), |x| * 127 / max |x| <= 127: no saturation needed.
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qg), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qg + 16), _mm512_cvtsepi32_epi8(qb));
        out.qsum[r * groups + g] =
            static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
        out.d[r * groups + g] = amax / 127.f;
      }
  });
  return out;
}

// Quad c of a row block as one vector: lane r holds row r's codes at inputs 4c .. 4c + 3, one
// unsigned byte each (byte 2r + j of the layout holds inputs 4c + j and 4c + 2 + j of row r).
template <High H>
inline __m512i unpack_quad(const uint8_t* q4, const void* high, int64_t c) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q4 + c * 32));
  __m256i lo = _mm256_and_si256(v, nibble);
  __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
  if constexpr (H == High::kFifthBit) {
    const uint32_t* fifth = static_cast<const uint32_t*>(high) + c * 2;
    const __m256i sixteen = _mm256_set1_epi8(16);
    lo = _mm256_mask_add_epi8(lo, _cvtu32_mask32(fifth[0]), lo, sixteen);
    hi = _mm256_mask_add_epi8(hi, _cvtu32_mask32(fifth[1]), hi, sixteen);
  } else if constexpr (H == High::kNibble) {
    const __m256i u = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint8_t*>(high) + c * 32));
    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(u, nibble), 4));
    hi = _mm256_or_si256(hi, _mm256_andnot_si256(nibble, u));
  }
  // Word 2r from lo's word r (inputs 4c, 4c + 1), word 2r + 1 from hi's (4c + 2, 4c + 3).
  const __m512i order = _mm512_set_epi16(
      47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  return _mm512_permutex2var_epi16(_mm512_castsi256_si512(lo), order,
                                   _mm512_castsi256_si512(hi));
}

// The 16 outputs of a row block for R rows of quantized x (codes: the block's unpacked quads).
template <int R, typename S>
inline void int8_rows_block(const uint8_t* codes, const S* sz, const int8_t* xq,
                            const float* d, const float* qsum, int64_t k, __m512* acc) {
  const int64_t groups = k / 32;
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[R];
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m512i w = _mm512_loadu_si512(codes + (g * 8 + c) * 64);
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, xq + r * k + g * 32 + c * 4, 4);
        dot[r] = _mm512_dpbusd_epi32(dot[r], w, _mm512_set1_epi32(quad));
      }
    }
    __m512 scale, offset;
    if constexpr (std::is_same_v<S, float>) {
      scale = _mm512_loadu_ps(sz + g * 32);
      offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), scale, _mm512_loadu_ps(sz + g * 32 + 16));
    } else {
      scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + g * 32)));
      offset = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + g * 32 + 16)));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 offsets = _mm512_mul_ps(offset, _mm512_set1_ps(qsum[r * groups + g]));
      const __m512 sum = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot[r]), offsets);
      acc[r] = _mm512_fmadd_ps(sum, _mm512_set1_ps(d[r * groups + g]), acc[r]);
    }
  }
}

#else
constexpr bool kInt4Int8Gemm = false;
#endif

}  // namespace

#include "int4_int8_avx2.h"

// x [M, K] (bf16 or float32) times codes in octavo's int4 layout (with `high`: 5- or 8-bit) ->
// [M, N] in x's dtype, N the padded row count, x quantized to int8 per row and 32 inputs.
at::Tensor int4_int8_gemm(at::Tensor x, at::Tensor q4, at::Tensor sz,
                          std::optional<at::Tensor> high) {
  TORCH_CHECK(kInt4Int8Gemm || (kInt4Int8GemmAvx2 && x.scalar_type() == at::kFloat),
              "int4_int8_gemm needs AVX-512 VNNI, or AVX2 with float32 activations");
  const High kind = check_int4_layout("int4_int8_gemm", x, q4, sz, high);
  const int64_t rows = x.size(0), k = x.size(1), blocks = q4.size(0), n = blocks * 16;
  auto out = at::empty({rows, n}, x.options());
#if defined(OCTAVO_INT4_INT8_AVX2)
  int4_int8_gemm_avx2(x, q4, sz, high, kind, out);
  return out;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const bool half_scales = sz.scalar_type() == at::kHalf;
  const int64_t groups = k / 32;
  const QuantizedRows xq = x.scalar_type() == at::kBFloat16
                               ? quantize_rows(x.data_ptr<c10::BFloat16>(), rows, k)
                               : quantize_rows(x.data_ptr<float>(), rows, k);
  const uint8_t* qp = q4.data_ptr<uint8_t>();
  const uint8_t* hp = high ? static_cast<const uint8_t*>(high->data_ptr()) : nullptr;
  const int64_t plane_bytes = kind == High::kNibble ? k * 8 : kind == High::kFifthBit ? k * 2 : 0;
  // Rows of x a sweep over the weights takes: their int8 copy (256 K bytes) stays in L2 while
  // every row block is unpacked once for them.
  const int64_t sweep = std::max<int64_t>(8, (int64_t{256} << 10) / k / 8 * 8);
  auto run = [&](const auto* sp, auto* op) {
    for (int64_t first = 0; first < rows; first += sweep) {
      const int64_t last = std::min(rows, first + sweep);
      at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
        std::vector<uint8_t> codes(k * 16);  // k / 4 vectors of 64 bytes
        __m512 acc[8];
        for (int64_t b = begin; b < end; ++b) {
          const uint8_t* qb = qp + b * k * 8;
          const uint8_t* hb = hp + b * plane_bytes;
          const auto* sb = sp + b * groups * 32;
          with_high(kind, [&](auto h) {
            constexpr High H = decltype(h)::value;
            for (int64_t c = 0; c < k / 4; ++c)
              _mm512_storeu_si512(codes.data() + c * 64, unpack_quad<H>(qb, hb, c));
            for (int64_t c = first; c < last; c += 8) {
              const int64_t m = std::min<int64_t>(8, last - c);
              for_rows(m, [&](auto r) {
                int8_rows_block<decltype(r)::value>(codes.data(), sb, xq.q.data() + c * k,
                                                    xq.d.data() + c * groups,
                                                    xq.qsum.data() + c * groups, k, acc);
              });
              for (int64_t r = 0; r < m; ++r) store16(op + (c + r) * n + b * 16, acc[r]);
            }
          });
        }
      });
    }
  };
  auto with_scales = [&](auto* op) {
    if (half_scales) run(sz.data_ptr<at::Half>(), op);
    else run(sz.data_ptr<float>(), op);
  };
  if (x.scalar_type() == at::kBFloat16) with_scales(out.data_ptr<c10::BFloat16>());
  else with_scales(out.data_ptr<float>());
#endif
  return out;
}
