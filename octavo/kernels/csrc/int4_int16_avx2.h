// Codes in octavo's int4 layout (4, 5 or 8 bits; int4_gemm.h) times rows of float32 activations
// quantized to int16, with AVX2: the product where bf16 is not native, and its entry point
// int4_int16_gemm. Included by cpu_ops.cpp only, after int4_int8_gemm.h.
#pragma once

// Why: the exact float32 kernel (int4_block_f32, and its panel past a few rows) spends a
// conversion and an FMA on every code and row: at one row that, not memory, bounds it (10-20
// GB/s of weights on an AMD EPYC with AVX2, 5-bit codes the slowest; docs/performance.md), and
// at many rows the FMA ports. vpmaddwd multiplies 16 pairs of 16-bit words and adds each pair
// into 32 bits: with the codes widened to words and x quantized per row and 32 inputs to
// q = round(x * 32767 / max |x|), a quad of a row block (16 rows x 4 inputs) costs four of them
// a row of x, twice the products of an FMA. The rounding error is at most max |x| / 65534 an
// input: 2^-15 of a group's largest input where bf16 rounding is 2^-9 of each input, so this is
// nearer the exact product than bf16 activations are. Per group, as in int4_int8_gemm.h,
//   sum x * w ~ d * (scale * sum code * q + offset * sum q), d = max |x| / 32767,
// and a group's int32 sums stay below 32 * 255 * 32767 < 2^31.

namespace {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

constexpr bool kInt4Int16Gemm = true;

struct Int16Rows {
  std::vector<int16_t> q;   // [M, K]
  std::vector<float> d;     // [M, K / 32]
  std::vector<float> qsum;  // [M, K / 32]
};

inline Int16Rows quantize_rows_int16(const float* x, int64_t rows, int64_t k) {
  const int64_t groups = k / 32;
  Int16Rows out{std::vector<int16_t>(rows * k), std::vector<float>(rows * groups),
                std::vector<float>(rows * groups)};
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xg = x + r * k + g * 32;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xg + 8 * i);
      const float amax = max8(_mm256_max_ps(
          _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
          _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3]))));
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      // packs work within 128-bit lanes: `order` puts each pair's words back in input order.
      int16_t* qg = out.q.data() + r * k + g * 32;
      for (int i = 0; i < 2; ++i)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg + 16 * i),
                            _mm256_permutevar8x32_epi32(
                                _mm256_packs_epi32(q[2 * i], q[2 * i + 1]), order));
      const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                         _mm256_add_epi32(q[2], q[3]));
      out.qsum[r * groups + g] = sum8(_mm256_cvtepi32_ps(s));
      out.d[r * groups + g] = amax / 32767.f;
    }
  return out;
}

// A quad of a row block as 16-bit words: [i][h] holds rows 8h .. 8h + 7, each row's codes at
// inputs 4c + 2i and 4c + 2i + 1 as one dword.
template <High H>
inline void quad_words(const uint8_t* q4, const void* high, int64_t c, __m256i words[2][2]) {
  __m256i lo, hi;
  quad_code_bytes<H>(q4, high, c, lo, hi);
  words[0][0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo));
  words[0][1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1));
  words[1][0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi));
  words[1][1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1));
}

// A row block's codes as words, once, for every chunk of rows to read from L1 or L2 (k / 4
// quads, 4 vectors each): widening in the inner loop cost as much as the products past a few
// rows, and the exact panel won there.
template <High H>
inline void widen_block(const uint8_t* q4, const void* high, int64_t k, __m256i* widened) {
  for (int64_t c = 0; c < k / 4; ++c)
    quad_words<H>(q4, high, c, reinterpret_cast<__m256i(*)[2]>(widened + 4 * c));
}

// Output rows 16b .. 16b + 15 of R rows of int16 x, to out + r * out_stride; the codes from
// q4 and high, or (Widened) from the block's words. Not inlined: inside its caller's loops GCC
// spilled the 4-bit instantiation's sums (twice its time at 64 rows).
template <int R, High H, bool Widened, typename S>
__attribute__((noinline)) void int16_block(const uint8_t* q4, const void* high,
                                           const __m256i* widened, const S* sz,
                                           const int16_t* xq, const float* d, const float* qsum,
                                           int64_t k, float* out, int64_t out_stride,
                                           bool once) {
  const int64_t groups = k / 32;
  // The sums of each row (16 floats) stay in memory between groups: beside the R x 2 dwords a
  // group adds up, in registers, they would spill (AVX2 has 16).
  alignas(32) float acc[R][16] = {};
  for (int64_t g = 0; g < groups; ++g) {
    if constexpr (!Widened) prefetch_group<H>(q4, high, sz, g, once);
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const int64_t c = g * 8 + i;
      __m256i words[2][2];
      if constexpr (Widened) {
        for (int j = 0; j < 4; ++j) words[j / 2][j % 2] = _mm256_load_si256(widened + 4 * c + j);
        // In registers for every row: folded into each vpmaddwd, they were loaded R times.
        asm("" : "+x"(words[0][0]), "+x"(words[0][1]), "+x"(words[1][0]), "+x"(words[1][1]));
      } else {
        quad_words<H>(q4, high, c, words);
      }
      for (int r = 0; r < R; ++r) {
        int32_t pair[2];
        std::memcpy(pair, xq + r * k + c * 4, 8);
        const __m256i x01 = _mm256_set1_epi32(pair[0]), x23 = _mm256_set1_epi32(pair[1]);
        for (int h = 0; h < 2; ++h)
          dot[r][h] = _mm256_add_epi32(
              dot[r][h], _mm256_add_epi32(_mm256_madd_epi16(words[0][h], x01),
                                          _mm256_madd_epi16(words[1][h], x23)));
      }
      // As in int8_block_avx2: keeps GCC from reassociating the sums across the quads.
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) asm("" : "+x"(dot[r][h]));
    }
    for (int h = 0; h < 2; ++h) {
      __m256 scale, offset;
      if constexpr (std::is_same_v<S, float>) {
        scale = _mm256_loadu_ps(sz + g * 32 + 8 * h);
        offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), scale,
                                  _mm256_loadu_ps(sz + g * 32 + 16 + 8 * h));
      } else {
        scale = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sz + g * 32 + 8 * h)));
        offset = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sz + g * 32 + 16 + 8 * h)));
      }
      for (int r = 0; r < R; ++r) {
        const __m256 sum = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot[r][h]),
                                           _mm256_mul_ps(offset,
                                                         _mm256_set1_ps(qsum[r * groups + g])));
        _mm256_store_ps(acc[r] + 8 * h,
                        _mm256_fmadd_ps(sum, _mm256_set1_ps(d[r * groups + g]),
                                        _mm256_load_ps(acc[r] + 8 * h)));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(out + r * out_stride + 8 * h, _mm256_load_ps(acc[r] + 8 * h));
}

#else
constexpr bool kInt4Int16Gemm = false;
#endif

}  // namespace

// x [M, K] float32, quantized to int16 per row and 32 inputs, times codes in octavo's int4
// layout (with `high`: 5- or 8-bit) -> [M, N] float32, N the padded row count. Up to 4 rows
// the codes are widened as they stream (one pass over the weights); past that each row block
// is widened once and every 4 rows of x run over its words.
at::Tensor int4_int16_gemm(at::Tensor x, at::Tensor q4, at::Tensor sz,
                           std::optional<at::Tensor> high) {
  TORCH_CHECK(kInt4Int16Gemm, "int4_int16_gemm needs AVX2, FMA and F16C");
  const High kind = check_int4_layout("int4_int16_gemm", x, q4, sz, high);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int4_int16_gemm: x must be float32");
  const int64_t rows = x.size(0), k = x.size(1), blocks = q4.size(0), n = blocks * 16;
  auto out = at::empty({rows, n}, x.options());
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const int64_t groups = k / 32;
  const Int16Rows xq = quantize_rows_int16(x.data_ptr<float>(), rows, k);
  const uint8_t* qp = q4.data_ptr<uint8_t>();
  const uint8_t* hp = high ? static_cast<const uint8_t*>(high->data_ptr()) : nullptr;
  const int64_t plane_bytes = kind == High::kNibble ? k * 8 : kind == High::kFifthBit ? k * 2 : 0;
  float* op = out.data_ptr<float>();
  constexpr int64_t kChunk = 4;  // rows of x a pass over a row block
  const bool stream = rows <= kChunk;
  auto run = [&](const auto* sp) {
    at::parallel_for(0, blocks, stream ? 4 : 1, [&](int64_t begin, int64_t end) {
      std::vector<__m256i> widened(stream ? 0 : k);  // k / 4 quads, 4 vectors each
      for (int64_t b = begin; b < end; ++b)
        with_high(kind, [&](auto h) {
          constexpr High H = decltype(h)::value;
          const uint8_t* qb = qp + b * k * 8;
          const uint8_t* hb = hp + b * plane_bytes;
          const auto* sb = sp + b * groups * 32;
          if (!stream) widen_block<H>(qb, hb, k, widened.data());
          for (int64_t c = 0; c < rows; c += kChunk)
            for_rows(std::min(kChunk, rows - c), [&](auto r) {
              constexpr int R = decltype(r)::value;
              if constexpr (R <= kChunk) {
                const int16_t* xr = xq.q.data() + c * k;
                const float* dr = xq.d.data() + c * groups;
                const float* sr = xq.qsum.data() + c * groups;
                float* ob = op + c * n + b * 16;
                if (stream)
                  int16_block<R, H, false>(qb, hb, nullptr, sb, xr, dr, sr, k, ob, n, true);
                else
                  int16_block<R, H, true>(qb, hb, widened.data(), sb, xr, dr, sr, k, ob, n, false);
              }
            });
        });
    });
  };
  if (sz.scalar_type() == at::kHalf) run(sz.data_ptr<at::Half>());
  else run(sz.data_ptr<float>());
#endif
  return out;
}
