// Microscaled low-bit weights (OCP MX: MXFP4, MXFP8; NVIDIA's NVFP4; FP8 with a scale per row or
// block): each row of the weight is blocks of `block` inputs, each block a scale and `block`
// codes of 4 or 8 bits (two 4-bit codes a byte, the even input in the low nibble). A code is a
// float by a lookup table (e2m1's 16 values, e4m3's 256) and a scale byte a float by another
// (e8m0: 2^(s - 127); e4m3 times a tensor scale), or the scales are float32 (FP8 checkpoints),
// so one kernel serves every format: w[n, k] = scale[n, k / block] * code_lut[c[n, k]].
//
// microscaled_gemv: x [M, K] (M small: decode) times the weight, the codes read once for every
// row of x: each block decoded into floats once, then dotted with each row's block and scaled
// (AVX-512: any 4-bit table and e4m3 sixteen codes a vector; AVX2: e2m1 sixteen at a time by a
// byte shuffle, e4m3 eight; other tables by the table).
// microscaled_dequantize: rows of the weight as floats; microscaled_tiled_linear: large batches
// (prefill), the weight dequantized a tile of rows at a time into the dense GEMM.
// Included by cpu_ops.cpp only, after dequant.h.
#pragma once

#include <ATen/Parallel.h>

namespace {

struct MicroscaledLayout {
  int64_t n, k, block, bits;
  const uint8_t* codes;   // [N, K * bits / 8]
  const uint8_t* scales;  // [N, K / block] bytes, read through scale_lut; or
  const float* float_scales;  // [N, K / block] float32 (FP8 checkpoints' scales)
  const float* code_lut;  // 16 or 256 entries
  const float* scale_lut;  // 256 entries
  bool e2m1 = false;  // the codes are e2m1's 16 values (MXFP4, NVFP4): decoded with shuffles
  bool e4m3 = false;  // the codes are float8_e4m3fn bytes: decoded with integer ops
  bool bf16_table = false;  // 4-bit codes whose every value is a bfloat16 (e2m1's are)

  float scale(int64_t n, int64_t b) const {
    const int64_t i = n * (k / block) + b;
    return float_scales != nullptr ? float_scales[i] : scale_lut[scales[i]];
  }
};

// decode8_e4m3's and decode16_e4m3's values times this are e4m3's.
constexpr float kE4m3Rescale = 256.f;

// e2m1's values times 2 are the integers 0, 1, 2, 3, 4, 6, 8, 12 and their negatives.
constexpr float kE2m1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                             -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

#if defined(__AVX2__) && defined(__FMA__)
// 16 e2m1 codes (8 bytes, the even input in the low nibble) as 2 x 8 floats, times 2.
inline void decode16_e2m1(const uint8_t* c, __m256& lo8, __m256& hi8) {
  const __m128i twice = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
  const __m128i nib = _mm_set1_epi8(15);
  const __m128i low = _mm_and_si128(bytes, nib);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nib);
  const __m128i values = _mm_shuffle_epi8(twice, _mm_unpacklo_epi8(low, high));  // in order
  lo8 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(values));
  hi8 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(values, 8)));
}

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// 8 float8_e4m3fn bytes as floats times 2^-8: each byte becomes a float16 (the sign kept, the
// exponent and mantissa shifted one bit down: float16's exponent bias is 8 more than e4m3's),
// which widens exactly, subnormals included (F16C). The scale takes kE4m3Rescale. (Zen 4, one
// thread, AVX2 build: half the time of placing the fields into float32's, with a float path for
// subnormals.)
inline __m256 decode8_e4m3(const uint8_t* c) {
  const __m128i high = _mm_slli_epi16(
      _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))), 8);
  return _mm256_cvtph_ps(
      _mm_and_si128(_mm_srai_epi16(high, 1), _mm_set1_epi16(static_cast<short>(0xBFFF))));
}

// Rows [begin, end) of the product for up to 8 rows of x at a time: each run of `Step` codes
// decoded once (`decode(n, j, v)` fills Step / 8 vectors with inputs j.. of row n, times
// `unit`), then one multiply-add per vector and row of x; each row's block sum joins its
// accumulator times the block's scale and `unit`'s inverse (`rescale`).
template <int64_t Step, typename Decode>
inline void simd_gemv_rows(const MicroscaledLayout& w, const float* xp, int64_t m, float* op,
                           int64_t begin, int64_t end, float rescale, Decode decode) {
  const int64_t blocks = w.k / w.block;
  for (int64_t r0 = 0; r0 < m; r0 += 8) {
    const int64_t rows = std::min<int64_t>(8, m - r0);
    for (int64_t n = begin; n < end; ++n) {
      __m256 acc[8];
      for (int64_t r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        const __m256 s = _mm256_set1_ps(rescale * w.scale(n, b));
        __m256 part[8];
        for (int64_t r = 0; r < rows; ++r) part[r] = _mm256_setzero_ps();
        for (int64_t j = b * w.block; j < (b + 1) * w.block; j += Step) {
          __m256 v[Step / 8];
          decode(n, j, v);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t q = 0; q < Step / 8; ++q)
              part[r] = _mm256_fmadd_ps(v[q], _mm256_loadu_ps(xp + (r0 + r) * w.k + j + 8 * q),
                                        part[r]);
        }
        for (int64_t r = 0; r < rows; ++r) acc[r] = _mm256_fmadd_ps(part[r], s, acc[r]);
      }
      for (int64_t r = 0; r < rows; ++r) op[(r0 + r) * w.n + n] = hsum8(acc[r]);
    }
  }
}

// e2m1 codes 16 at a time (the table's values are twice e2m1's: the scale takes the half);
// e4m3 codes 8 at a time.
inline void e2m1_gemv_rows(const MicroscaledLayout& w, const float* xp, int64_t m, float* op,
                           int64_t begin, int64_t end) {
  simd_gemv_rows<16>(w, xp, m, op, begin, end, 0.5f, [&](int64_t n, int64_t j, __m256* v) {
    decode16_e2m1(w.codes + n * (w.k / 2) + j / 2, v[0], v[1]);
  });
}

inline void e4m3_gemv_rows(const MicroscaledLayout& w, const float* xp, int64_t m, float* op,
                           int64_t begin, int64_t end) {
  simd_gemv_rows<8>(w, xp, m, op, begin, end, kE4m3Rescale,
                    [&](int64_t n, int64_t j, __m256* v) {
                      v[0] = decode8_e4m3(w.codes + n * w.k + j);
                    });
}
#endif

}  // namespace

#include "microscaled_avx512.h"

namespace {

// One block of row n decoded into `out` (`block` floats), unscaled.
inline void decode_block(const MicroscaledLayout& w, int64_t n, int64_t b, float* out) {
  if (w.bits == 4) {
    const uint8_t* c = w.codes + n * (w.k / 2) + b * (w.block / 2);
    for (int64_t j = 0; j < w.block / 2; ++j) {
      out[2 * j] = w.code_lut[c[j] & 15];
      out[2 * j + 1] = w.code_lut[c[j] >> 4];
    }
  } else {
    const uint8_t* c = w.codes + n * w.k + b * w.block;
    for (int64_t j = 0; j < w.block; ++j) out[j] = w.code_lut[c[j]];
  }
}

// scales: uint8 read through scale_lut (256 floats), or float32 (scale_lut empty).
MicroscaledLayout microscaled_layout(const at::Tensor& codes, const at::Tensor& scales,
                                     const at::Tensor& code_lut, const at::Tensor& scale_lut,
                                     int64_t block) {
  const bool float_scales = scales.scalar_type() == at::kFloat;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.dim() == 2 &&
                  (float_scales || scales.scalar_type() == at::kByte) &&
                  scales.is_contiguous() && scales.dim() == 2,
              "microscaled: uint8 codes [N, K * bits / 8] and uint8 or float32 scales "
              "[N, K / block], contiguous");
  TORCH_CHECK(code_lut.scalar_type() == at::kFloat && scale_lut.scalar_type() == at::kFloat &&
                  (code_lut.numel() == 16 || code_lut.numel() == 256) &&
                  scale_lut.numel() == (float_scales ? 0 : 256),
              "microscaled: float32 tables of 16 or 256 code values and of 256 scale values "
              "(none with float32 scales)");
  const int64_t bits = code_lut.numel() == 16 ? 4 : 8;
  const int64_t n = codes.size(0), k = codes.size(1) * 8 / bits;
  TORCH_CHECK(block > 0 && block % 16 == 0 && k % block == 0 && scales.size(0) == n &&
                  scales.size(1) == k / block,
              "microscaled: ", n, " rows of ", k, " inputs in blocks of ", block,
              " (a multiple of 16) need scales [", n, ", ", k / std::max<int64_t>(block, 1),
              "], got [", scales.size(0), ", ", scales.size(1), "]");
  MicroscaledLayout w{n, k, block, bits, codes.data_ptr<uint8_t>(),
                      float_scales ? nullptr : scales.data_ptr<uint8_t>(),
                      float_scales ? scales.data_ptr<float>() : nullptr,
                      code_lut.data_ptr<float>(),
                      float_scales ? nullptr : scale_lut.data_ptr<float>()};
  const auto same = [](float a, float b) {
    return (a == b && std::signbit(a) == std::signbit(b)) || (std::isnan(a) && std::isnan(b));
  };
  w.e2m1 = bits == 4 && std::equal(kE2m1, kE2m1 + 16, w.code_lut, same);
  w.bf16_table = bits == 4 && std::all_of(w.code_lut, w.code_lut + 16, [](float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return (u & 0xFFFF) == 0;
  });
  if (bits == 8) {
    static const std::vector<float> kE4m3 = [] {
      const auto t = at::arange(256, at::kByte).view(at::kFloat8_e4m3fn).to(at::kFloat);
      return std::vector<float>(t.data_ptr<float>(), t.data_ptr<float>() + 256);
    }();
    w.e4m3 = std::equal(w.code_lut, w.code_lut + 256, kE4m3.begin(), same);
  }
  return w;
}

}  // namespace

at::Tensor microscaled_gemv(at::Tensor x, at::Tensor codes, at::Tensor scales,
                            at::Tensor code_lut, at::Tensor scale_lut, int64_t block) {
  const MicroscaledLayout w = microscaled_layout(codes, scales, code_lut, scale_lut, block);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.k, "microscaled_gemv: x must be [M, ", w.k, "]");
  const int64_t m = x.size(0);
  auto out = at::empty({m, w.n}, x.options().dtype(at::kFloat));
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (x.scalar_type() == at::kBFloat16 && bf16_gemv_takes(w)) {
    const auto xb = x.contiguous();
    const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
    at::parallel_for(0, w.n, 16, [&](int64_t begin, int64_t end) {
      bf16_gemv_rows(w, xp, m, out.data_ptr<float>(), begin, end);
    });
    return out.to(x.scalar_type());
  }
#endif
  auto xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = w.k / w.block;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (w.bits == 4 || w.e4m3) {
    const auto gemv = [&](const auto& decode, const float* x_laid_out) {
      at::parallel_for(0, w.n, 16, [&](int64_t begin, int64_t end) {
        simd16_gemv_rows(w, decode, x_laid_out, m, op, begin, end);
      });
    };
    if (w.bits == 4 && w.block % 32 == 0)
      gemv(NibblePairDecode{{w.codes, w.k, _mm512_loadu_ps(w.code_lut)}},
           deinterleave32(xp, m, w.k).data());
    else
      with_decode16(w, [&](const auto& decode) { gemv(decode, xp); });
    return out.to(x.scalar_type());
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (w.e2m1 || w.e4m3) {
    at::parallel_for(0, w.n, 16, [&](int64_t begin, int64_t end) {
      if (w.e2m1)
        e2m1_gemv_rows(w, xp, m, op, begin, end);
      else
        e4m3_gemv_rows(w, xp, m, op, begin, end);
    });
    return out.to(x.scalar_type());
  }
#endif
  at::parallel_for(0, w.n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(m), buf(w.block);
    for (int64_t n = begin; n < end; ++n) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < blocks; ++b) {
        decode_block(w, n, b, buf.data());
        const float s = w.scale(n, b);
        const float* bp = buf.data();
        for (int64_t r = 0; r < m; ++r) {
          const float* xr = xp + r * w.k + b * w.block;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t j = 0; j < w.block; ++j) dot += xr[j] * bp[j];
          acc[r] += s * dot;
        }
      }
      for (int64_t r = 0; r < m; ++r) op[r * w.n + n] = acc[r];
    }
  });
  return out.to(x.scalar_type());
}

at::Tensor microscaled_dequantize(at::Tensor codes, at::Tensor scales, at::Tensor code_lut,
                                  at::Tensor scale_lut, int64_t block, int64_t first,
                                  int64_t count) {
  const MicroscaledLayout w = microscaled_layout(codes, scales, code_lut, scale_lut, block);
  TORCH_CHECK(first >= 0 && count >= 0 && first + count <= w.n,
              "microscaled_dequantize: rows out of range");
  auto out = at::empty({count, w.k}, at::TensorOptions().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const int64_t blocks = w.k / w.block;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (w.bits == 4 || w.e4m3) {
    with_decode16(w, [&](const auto& decode) {
      at::parallel_for(0, count, 8, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          for (int64_t b = 0; b < blocks; ++b)
            dequantize16_block(w, decode, first + r, b, op + r * w.k + b * w.block);
      });
    });
    return out;
  }
#endif
  at::parallel_for(0, count, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = first + r;
      for (int64_t b = 0; b < blocks; ++b) {
        float* dst = op + r * w.k + b * w.block;
        const float s = w.scale(n, b);
#if defined(__AVX2__) && defined(__FMA__)
        if (w.e2m1) {
          const __m256 half_s = _mm256_set1_ps(0.5f * s);
          for (int64_t j = 0; j < w.block; j += 16) {
            __m256 v0, v1;
            decode16_e2m1(w.codes + n * (w.k / 2) + (b * w.block + j) / 2, v0, v1);
            _mm256_storeu_ps(dst + j, _mm256_mul_ps(v0, half_s));
            _mm256_storeu_ps(dst + j + 8, _mm256_mul_ps(v1, half_s));
          }
          continue;
        }
        if (w.e4m3) {
          const __m256 vs = _mm256_set1_ps(kE4m3Rescale * s);
          for (int64_t j = 0; j < w.block; j += 8)
            _mm256_storeu_ps(dst + j, _mm256_mul_ps(
                decode8_e4m3(w.codes + n * w.k + b * w.block + j), vs));
          continue;
        }
#endif
        decode_block(w, n, b, dst);
        for (int64_t j = 0; j < w.block; ++j) dst[j] *= s;
      }
    }
  });
  return out;
}

// x [M, K] (bf16 or float32) times the weight -> [M, N] in x's dtype, tile by tile (dequant.h's
// tiled_linear): what the Python layer and the decode stack run past the GEMV's rows.
at::Tensor microscaled_tiled_linear(at::Tensor x, at::Tensor codes, at::Tensor scales,
                                    at::Tensor code_lut, at::Tensor scale_lut, int64_t block) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "microscaled_tiled_linear: x must be [M, K] bf16 or float32");
  return tiled_linear(x.contiguous(), codes.size(0), 1, [&](int64_t first, int64_t count) {
    return microscaled_dequantize(codes, scales, code_lut, scale_lut, block, first, count)
        .to(x.scalar_type());
  });
}
