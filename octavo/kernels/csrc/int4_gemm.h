// Int4 weights in octavo's layout times a few rows of bf16 (AVX-512-BF16) or float32 (AVX2)
// activations, and its entry point int4_gemm.
// Included by cpu_ops.cpp only (the kernels' translation unit), so calls between these files
// inline.
#pragma once

#include "streaming.h"

namespace {

// Int4 weights times a few rows of bf16 activations (decode), in octavo's own layout
// (octavo/model/quant/packed.py, Int4Packed.native_layout) so that unpacking costs less than
// the multiply and a step reads the weights at memory speed:
//   q4 [N / 16, K / 4, 32] bytes: byte 2r + j of (row block b, quad c) holds the codes of row
//      16b + r at inputs 4c + j (low nibble) and 4c + 2 + j (high nibble);
//   sz [N / 16, K / 32, 2, 16]: per row and 32 inputs, either float32 scale and zero
//      (w = (q - 8) * scale + zero, torch's form) or, where a GGUF's Q4_0/Q4_1 gave them,
//      float16 scale and low (w = scale * q + low) exactly as the file stores them: zero is then
//      8 * scale + low, computed here with the float32 operations the packing would have run,
//      so the products are the same and a step reads 5/6 of the bytes (the float32 pair was a
//      third of them).
// A 32-bit lane is one output row, so products accumulate per row with no horizontal sums:
// code q becomes the bf16 number 128 + q by or-ing in an exponent (no conversion), vdpbf16ps
// multiplies pairs of inputs exactly into float32, and per group
//   sum x * w = scale * sum x * (128 + q) + (zero - 136 * scale) * sum x.
// Wider codes add a plane beside the 4-bit one (`high`):
//   5 bits (a GGUF's Q5_0, w = d * q - 16 d): [N / 16, K / 4, 2] uint32 (int32 tensor): for (row
//      block b, quad c), bit 2r + j of the first word is the fifth bit of the code in the low
//      nibble of byte 2r + j, of the second word the one in its high nibble; a masked add puts 16
//      into the lanes whose bit is set: 128 + q stays an exact bf16 integer;
//   8 bits (a GGUF's Q8_0, w = d * q - 128 d): [N / 16, K / 4, 32] uint8, the codes' high nibbles
//      in the layout of the low ones; both nibbles take the 4-bit path, and
//   sum x * w = scale * (A + 16 B) + (zero - 2184 * scale) * sum x,
//      with A, B the sums over x * (128 + nibble) of the low and high nibbles.
enum class High { kNone, kFifthBit, kNibble };

// Group g of a row block kPrefetchBytes of codes on (in this block or a later one): its codes,
// its high nibbles (8-bit codes) and its scales.
template <High H, typename S>
inline void prefetch_group(const uint8_t* q4, const void* high, const S* sz, int64_t g,
                           bool once) {
  prefetch_lines(q4 + g * 256 + kPrefetchBytes, 256, once);
  if constexpr (H == High::kNibble)
    prefetch_lines(static_cast<const uint8_t*>(high) + g * 256 + kPrefetchBytes, 256, once);
  prefetch_lines(sz + g * 32 + kPrefetchBytes / 8, 32 * sizeof(S), once);
}

// body(std::integral_constant<High, kind>) for the kind given at run time.
template <typename F>
void with_high(High kind, F&& body) {
  if (kind == High::kNibble) body(std::integral_constant<High, High::kNibble>{});
  else if (kind == High::kFifthBit) body(std::integral_constant<High, High::kFifthBit>{});
  else body(std::integral_constant<High, High::kNone>{});
}

#if defined(__AVX512BF16__)
// Output rows 16b..16b+15 for R activation rows; acc[r] gets row r's 16 sums. `high` (the
// block's plane, see above) is read only with kFifthBit or kNibble.
template <int R, High H, typename S>
inline void int4_block(const uint8_t* q4, const S* sz, const void* high,
                       const c10::BFloat16* x, int64_t k, const float* xsum, __m512* acc,
                       bool once) {
  constexpr int P = R == 1 ? 2 : 1;  // one row alone: two chains per half, to hide latency
  constexpr int kPlanes = H == High::kNibble ? 2 : 1;
  const int64_t groups = k / 32;
  const __m512i low_nibble = _mm512_set1_epi16(0x0F), exponent = _mm512_set1_epi16(0x4300);
  const __m512i sixteen = _mm512_set1_epi16(16);
  const uint32_t* fifth = static_cast<const uint32_t*>(high);
  const uint8_t* nibbles = static_cast<const uint8_t*>(high);
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[kPlanes][R][2 * P];
    for (int pl = 0; pl < kPlanes; ++pl)
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 2 * P; ++i) part[pl][r][i] = _mm512_setzero_ps();
    const uint8_t* qg[2] = {q4 + g * 256, H == High::kNibble ? nibbles + g * 256 : nullptr};
    // The group kPrefetchBytes of codes on (in this block or a later one) and its scales.
    for (int pl = 0; pl < kPlanes; ++pl) prefetch_lines(qg[pl] + kPrefetchBytes, 256, once);
    prefetch_lines(sz + g * 32 + kPrefetchBytes / 8, 32 * sizeof(S), once);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      __m512i lo[kPlanes], hi[kPlanes];
      for (int pl = 0; pl < kPlanes; ++pl) {
        const __m512i w = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg[pl] + c * 32)));
        lo[pl] = _mm512_ternarylogic_epi32(w, low_nibble, exponent, 0xEA);  // a&b | c
        hi[pl] = _mm512_or_si512(_mm512_srli_epi16(w, 4), exponent);
      }
      if constexpr (H == High::kFifthBit) {
        const uint32_t* hc = fifth + (g * 8 + c) * 2;
        lo[0] = _mm512_mask_add_epi16(lo[0], _cvtu32_mask32(hc[0]), lo[0], sixteen);
        hi[0] = _mm512_mask_add_epi16(hi[0], _cvtu32_mask32(hc[1]), hi[0], sixteen);
      }
      const int p = (c % P) * 2;
      for (int r = 0; r < R; ++r) {
        const int32_t* xr = reinterpret_cast<const int32_t*>(x + r * k + g * 32 + c * 4);
        const __m512bh x0 = (__m512bh)_mm512_set1_epi32(xr[0]);
        const __m512bh x1 = (__m512bh)_mm512_set1_epi32(xr[1]);
        for (int pl = 0; pl < kPlanes; ++pl) {
          part[pl][r][p] = _mm512_dpbf16_ps(part[pl][r][p], (__m512bh)lo[pl], x0);
          part[pl][r][p + 1] = _mm512_dpbf16_ps(part[pl][r][p + 1], (__m512bh)hi[pl], x1);
        }
      }
    }
    __m512 scale, zero;
    if constexpr (std::is_same_v<S, float>) {
      scale = _mm512_loadu_ps(sz + g * 32);
      zero = _mm512_loadu_ps(sz + g * 32 + 16);
    } else {
      scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + g * 32)));
      const __m512 low = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + g * 32 + 16)));
      zero = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(8.f), scale), low);
    }
    const float bias = H == High::kNibble ? 2184.f : 136.f;
    const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(bias), scale, zero);
    const __m512 scale16 = _mm512_mul_ps(_mm512_set1_ps(16.f), scale);
    for (int r = 0; r < R; ++r) {
      for (int pl = 0; pl < kPlanes; ++pl) {
        __m512 dot = _mm512_add_ps(part[pl][r][0], part[pl][r][1]);
        if constexpr (P == 2) dot = _mm512_add_ps(dot, _mm512_add_ps(part[pl][r][2], part[pl][r][3]));
        acc[r] = _mm512_fmadd_ps(dot, pl == 0 ? scale : scale16, acc[r]);
      }
      acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
    }
  }
}
#endif

#if defined(__AVX2__)
// Byte i is 16 where bit i of `word` is set (a row block's fifth bits for one nibble of a quad).
inline __m256i fifth_bit_bytes(uint32_t word) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(word)), spread);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit),
                          _mm256_set1_epi8(16));
}

// Quad c of a row block as codes in bytes: lo byte 2r + j holds row r's code at input 4c + j,
// hi byte 2r + j at 4c + 2 + j (5- and 8-bit codes whole).
template <High H>
inline void quad_code_bytes(const uint8_t* q4, const void* high, int64_t c, __m256i& lo,
                            __m256i& hi) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q4 + c * 32));
  lo = _mm256_and_si256(v, nibble);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
  if constexpr (H == High::kFifthBit) {
    const uint32_t* fifth = static_cast<const uint32_t*>(high) + c * 2;
    lo = _mm256_or_si256(lo, fifth_bit_bytes(fifth[0]));
    hi = _mm256_or_si256(hi, fifth_bit_bytes(fifth[1]));
  } else if constexpr (H == High::kNibble) {
    const __m256i u = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint8_t*>(high) + c * 32));
    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(u, nibble), 4));
    hi = _mm256_or_si256(hi, _mm256_andnot_si256(nibble, u));
  }
}

#endif

#if defined(__AVX2__) && defined(__FMA__)
// The same layout times a few rows of float32 activations, for CPUs without AVX-512-BF16 (where
// the model computes in float32). A 32-bit lane is one output row again: a row's two bytes of a
// quad, widened to 32 bits, hold its codes for inputs 4c, 4c + 2, 4c + 1, 4c + 3 at bits 0, 4,
// 8 and 12. Each code is masked in place, not shifted down, and converts to q * 16^i; the
// activations come prescaled by 16^-i (a power of two: exact) and in that order (xs, see
// int4_gemm), so one AND, one conversion and one FMA make a lane's product. Wider codes put
// their high part above the nibble before the conversion (bit 4i + 4 up: 16 q_high * 16^i,
// below 2^24, exact): the high nibble from its plane, or the fifth bit of the lane's row from
// the word of its nibble (the low nibbles' word for i = 0, 2, the high nibbles' for 1, 3; bit
// 2r + j with j = i / 2). Per group,
//   sum x * w = scale * sum x * q + offset * sum x,
// with offset = low (w = scale * q + low, a GGUF's form) or zero - 8 * scale (torch's form).
// Output rows 16b..16b+15 of R activation rows go to out + r * out_stride.
template <int R, High H, typename S>
inline void int4_block_f32(const uint8_t* q4, const S* sz, const void* high, const float* xs,
                           int64_t k, const float* xsum, float* out, int64_t out_stride,
                           bool once) {
  // Independent sums per row and half: 2 pipes times a 4-5 cycle FMA latency want 8-10 chains
  // in flight, and one row has only its two halves.
  constexpr int P = R == 1 ? 4 : R == 2 ? 2 : 1;
  const int64_t groups = k / 32;
  const __m256i mask[4] = {_mm256_set1_epi32(0xF), _mm256_set1_epi32(0xF0),
                           _mm256_set1_epi32(0xF00), _mm256_set1_epi32(0xF000)};
  const uint8_t* nibbles = static_cast<const uint8_t*>(high);
  const uint32_t* fifth = static_cast<const uint32_t*>(high);
  const __m256i one = _mm256_set1_epi32(1);
  // Lane l of half h is row 8h + l: its fifth bits are bits 2 (8h + l) + j.
  const __m256i row_bit[2] = {_mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14),
                              _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30)};
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 part[R][2][P];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        for (int p = 0; p < P; ++p) part[r][h][p] = _mm256_setzero_ps();
    const uint8_t* qg = q4 + g * 256;
    prefetch_group<H>(q4, high, sz, g, once);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      __m256i v[2], u[2];
      for (int h = 0; h < 2; ++h) {
        v[h] = _mm256_cvtepu16_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + c * 32 + h * 16)));
        if constexpr (H == High::kNibble)
          u[h] = _mm256_cvtepu16_epi32(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(nibbles + g * 256 + c * 32 + h * 16)));
      }
      for (int i = 0; i < 4; ++i) {
        const int p = i % P;
        __m256 q[2];
        for (int h = 0; h < 2; ++h) {
          __m256i code = _mm256_and_si256(v[h], mask[i]);
          if constexpr (H == High::kNibble)
            code = _mm256_or_si256(code, _mm256_slli_epi32(_mm256_and_si256(u[h], mask[i]), 4));
          if constexpr (H == High::kFifthBit) {
            const __m256i word = _mm256_set1_epi32(static_cast<int>(fifth[(g * 8 + c) * 2 + (i & 1)]));
            const __m256i shift = _mm256_add_epi32(row_bit[h], _mm256_set1_epi32(i >> 1));
            const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(word, shift), one);
            code = _mm256_or_si256(code, _mm256_sllv_epi32(bit, _mm256_set1_epi32(4 * i + 4)));
          }
          q[h] = _mm256_cvtepi32_ps(code);
        }
        for (int r = 0; r < R; ++r) {
          const __m256 xv = _mm256_broadcast_ss(xs + r * k + g * 32 + c * 4 + i);
          part[r][0][p] = _mm256_fmadd_ps(q[0], xv, part[r][0][p]);
          part[r][1][p] = _mm256_fmadd_ps(q[1], xv, part[r][1][p]);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 scale, offset;
      if constexpr (std::is_same_v<S, float>) {
        scale = _mm256_loadu_ps(sz + g * 32 + 8 * h);
        offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), scale, _mm256_loadu_ps(sz + g * 32 + 16 + 8 * h));
      } else {
        scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sz + g * 32 + 8 * h)));
        offset = _mm256_cvtph_ps(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(sz + g * 32 + 16 + 8 * h)));
      }
      for (int r = 0; r < R; ++r) {
        __m256 dot = part[r][h][0];
        for (int p = 1; p < P; ++p) dot = _mm256_add_ps(dot, part[r][h][p]);
        acc[r][h] = _mm256_fmadd_ps(dot, scale, acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(offset, _mm256_set1_ps(xsum[r * groups + g]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * out_stride + 8 * h, acc[r][h]);
}
#endif

}  // namespace

bool built_with_avx512_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

bool built_with_avx2() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

// The rows of x from which the panel (panel_gemm.h) beats the streaming kernel: it pays
// the unpacking once, the stream once per 4 rows, which costs more the wider the codes. AMD
// EPYC Zen 2 (2 threads, cache-hot), panel / stream time: 4-bit codes 1.04 at 10 rows and 0.88
// at 20 (Qwen2.5's gate/up, 9,728 x 896), 5-bit 0.82 at 6 (its down, 896 x 4,864), 8-bit 1.04
// at 8 and 0.78 at 10 (Gemma 3's LM head).
inline int64_t panel_rows_from(High kind) {
  return kind == High::kNone ? 20 : kind == High::kFifthBit ? 6 : 8;
}

// x [M, K] float32 times int4 weights in octavo's layout, with `high` 5- or 8-bit codes ->
// [M, N] float32: a few rows streamed (int4_block_f32), more through the panel.
at::Tensor int4_gemm_f32(const at::Tensor& x, const at::Tensor& q4, const at::Tensor& sz,
                            bool half_scales, const std::optional<at::Tensor>& high, High kind) {
  TORCH_CHECK(built_with_avx2(), "int4_gemm with float32 activations needs AVX2 and FMA");
  const int64_t rows = x.size(0), k = x.size(1), blocks = q4.size(0), n = blocks * 16;
  if (rows >= panel_rows_from(kind)) return int4_panel_gemm_f32(x, q4, sz, high);
  auto out = at::empty({rows, n}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t groups = k / 32;
  const float* xp = x.data_ptr<float>();
  // Each row's inputs in the kernel's order (4c, 4c + 2, 4c + 1, 4c + 3), scaled by 16^-i, and
  // its sum over each group of 32.
  std::vector<float> xs(rows * k), xsum(rows * groups);
  constexpr int kOrder[4] = {0, 2, 1, 3};
  constexpr float kScale[4] = {1.f, 1.f / 16, 1.f / 256, 1.f / 4096};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < k; c += 4)
      for (int i = 0; i < 4; ++i) xs[r * k + c + i] = xp[r * k + c + kOrder[i]] * kScale[i];
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < 32; ++i) s += xp[r * k + g * 32 + i];
      xsum[r * groups + g] = s;
    }
  }
  const uint8_t* qp = q4.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const uint8_t* hp = high ? static_cast<const uint8_t*>(high->data_ptr()) : nullptr;
  const int64_t plane_bytes = kind == High::kNibble ? k * 8 : kind == High::kFifthBit ? k * 2 : 0;
  auto run = [&](const auto* sp) {
    // A row block (k / 2 bytes, k with a nibble plane) stays in L1 for every chunk of 4 rows.
    at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        for (int64_t c = 0; c < rows; c += 4) {
          const int64_t m = std::min<int64_t>(4, rows - c);
          for_rows(m, [&](auto r) {
            if constexpr (decltype(r)::value <= 4)
              with_high(kind, [&](auto h) {
                int4_block_f32<decltype(r)::value, decltype(h)::value>(
                    qp + b * k * 8, sp + b * groups * 32, hp + b * plane_bytes,
                    xs.data() + c * k, k, xsum.data() + c * groups, op + c * n + b * 16, n,
                    rows <= 4);
              });
          });
        }
    });
  };
  if (half_scales)
    run(sz.data_ptr<at::Half>());
  else
    run(sz.data_ptr<float>());
#endif
  return out;
}

// The arguments of a product with codes in octavo's layout, checked (`op` names the caller in
// the errors); the kind of their high plane.
inline High check_int4_layout(const char* op, const at::Tensor& x, const at::Tensor& q4,
                              const at::Tensor& sz, const std::optional<at::Tensor>& high) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
              (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              op, ": x must be a contiguous [M, K] bf16 or float32 tensor");
  TORCH_CHECK(q4.dim() == 3 && q4.size(2) == 32 && q4.scalar_type() == at::kByte &&
              q4.is_contiguous(), op, ": codes must be [N / 16, K / 4, 32] uint8");
  const int64_t k = x.size(1), blocks = q4.size(0);
  TORCH_CHECK(k % 32 == 0 && q4.size(1) * 4 == k, op, ": K must match, a multiple of 32");
  TORCH_CHECK((sz.scalar_type() == at::kHalf || sz.scalar_type() == at::kFloat) &&
              sz.is_contiguous() && sz.numel() == blocks * (k / 32) * 32,
              op, ": scales must be [N/16, K/32, 2, 16] float32 or float16");
  if (!high) return High::kNone;
  TORCH_CHECK(high->is_contiguous() &&
              ((high->scalar_type() == at::kInt && high->numel() == blocks * (k / 4) * 2) ||
               (high->scalar_type() == at::kByte && high->numel() == q4.numel())),
              op, ": the high plane must be fifth bits [N / 16, K / 4, 2] int32 or high "
              "nibbles [N / 16, K / 4, 32] uint8");
  return high->scalar_type() == at::kByte ? High::kNibble : High::kFifthBit;
}

// x [M, K] bf16 or float32 times int4 weights in octavo's layout (see int4_block) -> [M, N] in
// x's dtype, with N the padded row count (a multiple of 16); with `high`, 5- or 8-bit codes.
at::Tensor int4_gemm(at::Tensor x, at::Tensor q4, at::Tensor sz,
                     std::optional<at::Tensor> high) {
  const High kind = check_int4_layout("int4_gemm", x, q4, sz, high);
  const int64_t rows = x.size(0), k = x.size(1), blocks = q4.size(0), n = blocks * 16;
  const bool half_scales = sz.scalar_type() == at::kHalf;
  if (x.scalar_type() == at::kFloat) return int4_gemm_f32(x, q4, sz, half_scales, high, kind);
  TORCH_CHECK(built_with_avx512_bf16(), "int4_gemm with bf16 activations needs AVX-512-BF16");
  auto out = at::empty({rows, n}, x.options());
#if defined(__AVX512BF16__)
  const int64_t groups = k / 32;
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  std::vector<float> xsum(rows * groups);  // each row's sum over each group of 32 inputs
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < 32; ++i) s += static_cast<float>(xp[r * k + g * 32 + i]);
      xsum[r * groups + g] = s;
    }
  const uint8_t* qp = q4.data_ptr<uint8_t>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const uint8_t* hp = high ? static_cast<const uint8_t*>(high->data_ptr()) : nullptr;
  const int64_t plane_bytes = kind == High::kNibble ? k * 8 : kind == High::kFifthBit ? k * 2 : 0;
  // Two planes of partial sums hold twice the registers: 8-bit codes take 4 rows of x a pass.
  const int64_t chunk = kind == High::kNibble ? 4 : 8;
  auto run = [&](const auto* sp) {
    // A row block is k / 2 bytes (a few KB): it stays in L1 for every chunk of rows of x.
    at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
      __m512 acc[8];
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t c = 0; c < rows; c += chunk) {
          const int64_t m = std::min<int64_t>(chunk, rows - c);
          for_rows(m, [&](auto r) {
            constexpr int R = decltype(r)::value;
            const uint8_t* qb = qp + b * k * 8;
            const auto* sb = sp + b * groups * 32;
            const float* xs = xsum.data() + c * groups;
            with_high(kind, [&](auto h) {
              constexpr High H = decltype(h)::value;
              if constexpr (H != High::kNibble || R <= 4)
                int4_block<R, H>(qb, sb, hp + b * plane_bytes, xp + c * k, k, xs, acc,
                                 rows <= chunk);
            });
          });
          for (int64_t r = 0; r < m; ++r) store16(op + (c + r) * n + b * 16, acc[r]);
        }
      }
    });
  };
  if (half_scales)
    run(sz.data_ptr<at::Half>());
  else
    run(sz.data_ptr<float>());
#endif
  return out;
}
