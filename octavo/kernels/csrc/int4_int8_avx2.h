// Codes in octavo's int4 layout (4, 5 or 8 bits; int4_gemm.h) times float32 activations
// quantized to int8, with AVX2 (no VNNI): the arithmetic of int4_int8_gemm.h on 8-lane vectors.
// Included by int4_int8_gemm.h only, where AVX-512 VNNI is missing.
#pragma once

// Why: without AVX-512 a float32 product spends a conversion and a multiply-add on each code
// (int4_block_f32), and at one row that, not memory, bounds it: 10-20 GB/s of weights on an
// AMD EPYC with AVX2 (docs/performance.md). vpmaddubsw multiplies 32 unsigned bytes by 32
// signed ones and adds pairs into 16-bit words, so a quad of a row block (16 rows x 4 inputs)
// costs two of them a row of x.
// A quad becomes two vectors whose 32-bit lanes each hold one row's four codes (inputs
// 4c .. 4c + 3) as bytes: rows 0-3 and 8-11 in `a`, rows 4-7 and 12-15 in `b` (the order of
// vpunpck*wd within 128-bit lanes); outputs and scales are permuted to match, once per group.
// 4- and 5-bit codes are unsigned bytes: a word of vpmaddubsw is small enough that eight quads
// (4-bit) or four (5-bit) add up in 16 bits before vpmaddwd widens them. 8-bit codes would
// overflow a word, so they are taken as code - 128 (signed) against x with their signs
// (vpsignb; |code - 128| <= 128, a word at most 2 * 128 * 127), and the group adds
// 128 * scale * sum q back.

namespace {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    !(defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__))

constexpr bool kInt4Int8GemmAvx2 = true;
// For the entry's #if: a discarded `if constexpr` branch outside a template still names its
// callee, which builds with VNNI do not declare.
#define OCTAVO_INT4_INT8_AVX2 1

// Rows of float32 x quantized per 32 inputs as quantize_rows (int4_int8_gemm.h) does it:
// q = round(x * 127 / max |x|), to nearest even.
inline void quantize_rows_avx2(const float* x, int64_t rows, int64_t k, QuantizedRows& out) {
  const int64_t groups = k / 32;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const float* xg = x + r * k + g * 32;
        __m256 v[4];
        for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xg + 8 * i);
        const __m256 top = _mm256_max_ps(
            _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        const float amax = max8(top);
        const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        __m256i q[4];
        for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        // packs work within 128-bit lanes: dword i of the packed bytes holds q[i % 4]'s lanes
        // 4 (i / 4) .. + 3; `order` puts them back in input order.
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                                 _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + r * k + g * 32),
                            _mm256_permutevar8x32_epi32(bytes, order));
        const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                           _mm256_add_epi32(q[2], q[3]));
        out.qsum[r * groups + g] = sum8(_mm256_cvtepi32_ps(s));
        out.d[r * groups + g] = amax / 127.f;
      }
  });
}

// Quad c of a row block as (a, b) above; 8-bit codes minus 128.
template <High H>
inline void unpack_quad_avx2(const uint8_t* q4, const void* high, int64_t c, __m256i& a,
                             __m256i& b) {
  __m256i lo, hi;
  quad_code_bytes<H>(q4, high, c, lo, hi);
  if constexpr (H == High::kNibble) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    lo = _mm256_xor_si256(lo, flip);
    hi = _mm256_xor_si256(hi, flip);
  }
  a = _mm256_unpacklo_epi16(lo, hi);
  b = _mm256_unpackhi_epi16(lo, hi);
}

// Output rows 16b .. 16b + 15 for R rows of quantized x; the block's quads either unpacked here
// (Unpacked false: q4 and high) or read from `unpacked` (2 vectors a quad, unpack_quad_avx2).
// Not inlined: inlined into the entry's lambda, its registers were allocated with the rest of
// the lambda, and an edit to another kernel (int4_int16_avx2.h) halved its speed.
template <int R, High H, bool Unpacked, typename S>
__attribute__((noinline)) void int8_block_avx2(const uint8_t* q4, const void* high,
                                               const __m256i* unpacked, const S* sz,
                                               const int8_t* xq, const float* d,
                                               const float* qsum, int64_t k, float* out,
                                               int64_t out_stride, bool once) {
  constexpr bool kSigned = H == High::kNibble;
  // Quads whose words add up in 16 bits before vpmaddwd widens them: a word of vpmaddubsw is
  // at most 2 * 15 * 127 with 4-bit codes (8 quads: 30,480), 2 * 31 * 127 with 5-bit ones (4
  // quads: 31,496). Signed products are widened one by one.
  constexpr int kSpan = H == High::kNone ? 8 : 4;
  const int64_t groups = k / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    if constexpr (!Unpacked) prefetch_group<H>(q4, high, sz, g, once);
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int span = 0; span < 8 / kSpan; ++span) {
      __m256i words[R][2];
      for (int r = 0; r < R; ++r) words[r][0] = words[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int i = 0; i < kSpan; ++i) {
        const int64_t c = g * 8 + span * kSpan + i;
        __m256i w[2];
        if constexpr (Unpacked) {
          w[0] = _mm256_load_si256(unpacked + 2 * c);
          w[1] = _mm256_load_si256(unpacked + 2 * c + 1);
        } else {
          unpack_quad_avx2<H>(q4, high, c, w[0], w[1]);
        }
        __m256i magnitude[2];
        if constexpr (kSigned)
          for (int j = 0; j < 2; ++j) magnitude[j] = _mm256_abs_epi8(w[j]);
        for (int r = 0; r < R; ++r) {
          int32_t quad;
          std::memcpy(&quad, xq + r * k + c * 4, 4);
          const __m256i xv = _mm256_set1_epi32(quad);
          for (int j = 0; j < 2; ++j) {
            if constexpr (kSigned) {
              const __m256i p = _mm256_maddubs_epi16(magnitude[j], _mm256_sign_epi8(xv, w[j]));
              dot[r][j] = _mm256_add_epi32(dot[r][j], _mm256_madd_epi16(p, ones));
            } else {
              words[r][j] = _mm256_add_epi16(words[r][j], _mm256_maddubs_epi16(w[j], xv));
            }
          }
        }
        // Left free, GCC reassociates these sums: it computes the span's products first and
        // spills them to the stack, at 0.6-0.7x the speed (AMD EPYC Zen 3).
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 2; ++j) {
            if constexpr (kSigned) asm("" : "+x"(dot[r][j]));
            else asm("" : "+x"(words[r][j]));
          }
      }
      if constexpr (!kSigned)
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 2; ++j)
            dot[r][j] = _mm256_add_epi32(dot[r][j], _mm256_madd_epi16(words[r][j], ones));
    }
    // Scales and offsets of rows 0-7 and 8-15, into the (a, b) lane order.
    __m256 scale[2], offset[2];
    {
      __m256 s[2], o[2];
      for (int h = 0; h < 2; ++h) {
        if constexpr (std::is_same_v<S, float>) {
          s[h] = _mm256_loadu_ps(sz + g * 32 + 8 * h);
          o[h] = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s[h],
                                  _mm256_loadu_ps(sz + g * 32 + 16 + 8 * h));
        } else {
          s[h] = _mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(sz + g * 32 + 8 * h)));
          o[h] = _mm256_cvtph_ps(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(sz + g * 32 + 16 + 8 * h)));
        }
        if constexpr (kSigned) o[h] = _mm256_fmadd_ps(_mm256_set1_ps(128.f), s[h], o[h]);
      }
      scale[0] = _mm256_permute2f128_ps(s[0], s[1], 0x20);
      scale[1] = _mm256_permute2f128_ps(s[0], s[1], 0x31);
      offset[0] = _mm256_permute2f128_ps(o[0], o[1], 0x20);
      offset[1] = _mm256_permute2f128_ps(o[0], o[1], 0x31);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 qs = _mm256_set1_ps(qsum[r * groups + g]);
      const __m256 dr = _mm256_set1_ps(d[r * groups + g]);
      for (int j = 0; j < 2; ++j) {
        const __m256 sum = _mm256_fmadd_ps(scale[j], _mm256_cvtepi32_ps(dot[r][j]),
                                           _mm256_mul_ps(offset[j], qs));
        acc[r][j] = _mm256_fmadd_ps(sum, dr, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * out_stride, _mm256_permute2f128_ps(acc[r][0], acc[r][1], 0x20));
    _mm256_storeu_ps(out + r * out_stride + 8,
                     _mm256_permute2f128_ps(acc[r][0], acc[r][1], 0x31));
  }
}

// x [M, K] float32 times the codes, as int4_int8_gemm describes; the product for every row
// count (at one row the codes are unpacked as they stream; past a few, each row block once).
inline void int4_int8_gemm_avx2(const at::Tensor& x, const at::Tensor& q4, const at::Tensor& sz,
                                const std::optional<at::Tensor>& high, High kind,
                                at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = q4.size(0), n = blocks * 16;
  const int64_t groups = k / 32;
  QuantizedRows xq{std::vector<int8_t>(rows * k), std::vector<float>(rows * groups),
                   std::vector<float>(rows * groups)};
  quantize_rows_avx2(x.data_ptr<float>(), rows, k, xq);
  const uint8_t* qp = q4.data_ptr<uint8_t>();
  const uint8_t* hp = high ? static_cast<const uint8_t*>(high->data_ptr()) : nullptr;
  const int64_t plane_bytes = kind == High::kNibble ? k * 8 : kind == High::kFifthBit ? k * 2 : 0;
  float* op = out.data_ptr<float>();
  constexpr int64_t kChunk = 4;  // rows of x a pass over a row block
  const bool stream = rows <= kChunk;
  auto run = [&](const auto* sp) {
    at::parallel_for(0, blocks, stream ? 4 : 1, [&](int64_t begin, int64_t end) {
      std::vector<__m256i> unpacked(stream ? 0 : k / 2);  // k / 4 quads, 2 vectors each
      for (int64_t b = begin; b < end; ++b) {
        const uint8_t* qb = qp + b * k * 8;
        const uint8_t* hb = hp + b * plane_bytes;
        const auto* sb = sp + b * groups * 32;
        with_high(kind, [&](auto h) {
          constexpr High H = decltype(h)::value;
          if (!stream)
            for (int64_t c = 0; c < k / 4; ++c)
              unpack_quad_avx2<H>(qb, hb, c, unpacked[2 * c], unpacked[2 * c + 1]);
          // Two spans a group keep each row's int32 sums live beside its words: 2 rows a pass
          // then, so that they fit AVX2's 16 registers.
          constexpr int64_t chunk = H == High::kFifthBit ? 2 : kChunk;
          for (int64_t c = 0; c < rows; c += chunk) {
            const int64_t m = std::min<int64_t>(chunk, rows - c);
            for_rows(m, [&](auto r) {
              constexpr int R = decltype(r)::value;
              if constexpr (R <= chunk) {
                const int8_t* xr = xq.q.data() + c * k;
                const float* dr = xq.d.data() + c * groups;
                const float* qr = xq.qsum.data() + c * groups;
                if (stream)
                  int8_block_avx2<R, H, false>(qb, hb, nullptr, sb, xr, dr, qr, k,
                                               op + c * n + b * 16, n, true);
                else
                  int8_block_avx2<R, H, true>(qb, hb, unpacked.data(), sb, xr, dr, qr, k,
                                              op + c * n + b * 16, n, false);
              }
            });
          }
        });
      }
    });
  };
  if (sz.scalar_type() == at::kHalf) run(sz.data_ptr<at::Half>());
  else run(sz.data_ptr<float>());
}

#else
constexpr bool kInt4Int8GemmAvx2 = false;
#endif

}  // namespace
