// AVX-512 microscaled kernels (microscaled.h includes this after MicroscaledLayout): sixteen
// codes a vector, whatever the format's table, decoded in a few instructions, so that a GEMV row
// of 16 inputs costs about as many instructions as the FMAs it feeds.
#pragma once

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__)

// 16 4-bit codes (8 bytes, the even input in the low nibble), in input order, as their table's
// floats: the nibbles spread to 32-bit lanes index the 16-entry table (vpermps).
inline __m512 decode16_nibbles(const uint8_t* c, __m512 table) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c));
  const __m128i nib = _mm_set1_epi8(15);
  const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(bytes, nib),
                                          _mm_and_si128(_mm_srli_epi16(bytes, 4), nib));
  return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes), table);
}

// Row n's inputs j .. j + 16 decoded: 4-bit codes through their table, e4m3 bytes times 2^-8
// (`rescale` brings them back, with each block's scale).
// `pair` decodes inputs j .. j + 32 as two vectors in the order the GEMV's x is laid out in.
struct NibbleDecode {
  const uint8_t* codes;
  int64_t k;
  __m512 table;
  static constexpr float rescale = 1.f;
  static constexpr bool deinterleaved = false;
  __m512 operator()(int64_t n, int64_t j) const {
    return decode16_nibbles(codes + n * (k / 2) + j / 2, table);
  }
  void pair(int64_t n, int64_t j, __m512& v0, __m512& v1) const {
    v0 = (*this)(n, j);
    v1 = (*this)(n, j + 16);
  }
};

// 4-bit codes 32 at a time for a GEMV whose x is deinterleaved (each 32 inputs' even ones, then
// their odd ones: deinterleave32): 16 bytes widened to 32-bit lanes once index the table by
// their low nibbles (vpermps reads an index's low 4 bits) and, shifted, by their high ones. Half
// the shuffles of decode16_nibbles' input order.
struct NibblePairDecode : NibbleDecode {
  static constexpr bool deinterleaved = true;
  void pair(int64_t n, int64_t j, __m512& even, __m512& odd) const {
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + n * (k / 2) + j / 2)));
    even = _mm512_permutexvar_ps(bytes, table);
    odd = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  }
};

struct E4m3Decode {
  const uint8_t* codes;
  int64_t k;
  static constexpr float rescale = kE4m3Rescale;
  static constexpr bool deinterleaved = false;
  __m512 operator()(int64_t n, int64_t j) const { return decode16_e4m3(codes + n * k + j); }
  void pair(int64_t n, int64_t j, __m512& v0, __m512& v1) const {
    v0 = (*this)(n, j);
    v1 = (*this)(n, j + 16);
  }
};

// x [m, k] with each 32 inputs' even ones first, then their odd ones (NibblePairDecode's order).
inline std::vector<float> deinterleave32(const float* x, int64_t m, int64_t k) {
  std::vector<float> out(m * k);
  for (int64_t i = 0; i < m * k; i += 32)
    for (int64_t j = 0; j < 16; ++j) {
      out[i + j] = x[i + 2 * j];
      out[i + 16 + j] = x[i + 2 * j + 1];
    }
  return out;
}

// Calls f with the decoder of w's codes (AVX-512 decodes any 4-bit table, and e4m3).
template <typename F>
inline void with_decode16(const MicroscaledLayout& w, F&& f) {
  if (w.bits == 4)
    f(NibbleDecode{w.codes, w.k, _mm512_loadu_ps(w.code_lut)});
  else
    f(E4m3Decode{w.codes, w.k});
}

// Rows [begin, end) of the product for R rows of x (at most 8): each 16 codes decoded once, one
// FMA per row of x, two partial sums a row (the FMA chain of a block as long as a whole row,
// FP8's one scale a row, would otherwise set the pace); each block's sum joins the row's
// accumulator times its scale. R is a template argument so that the sums stay in registers.
template <int R, typename Decode>
inline void simd16_gemv_chunk(const MicroscaledLayout& w, const Decode& decode, const float* x0,
                              float* o0, int64_t begin, int64_t end) {
  const int64_t blocks = w.k / w.block;
  for (int64_t n = begin; n < end; ++n) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m512 even[R], odd[R];
      for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
      const int64_t first = b * w.block, last = first + w.block;
      int64_t j = first;
      for (; j + 32 <= last; j += 32) {
        __m512 v0, v1;
        decode.pair(n, j, v0, v1);
        for (int r = 0; r < R; ++r) {
          even[r] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(x0 + r * w.k + j), even[r]);
          odd[r] = _mm512_fmadd_ps(v1, _mm512_loadu_ps(x0 + r * w.k + j + 16), odd[r]);
        }
      }
      if constexpr (!Decode::deinterleaved) {  // blocks of 16 (NVFP4), or a block's last 16
        if (j < last) {
          const __m512 v = decode(n, j);
          for (int r = 0; r < R; ++r)
            even[r] = _mm512_fmadd_ps(v, _mm512_loadu_ps(x0 + r * w.k + j), even[r]);
        }
      }
      const __m512 s = _mm512_set1_ps(Decode::rescale * w.scale(n, b));
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_add_ps(even[r], odd[r]), s, acc[r]);
    }
    for (int r = 0; r < R; ++r) o0[r * w.n + n] = _mm512_reduce_add_ps(acc[r]);
  }
}

template <typename Decode>
inline void simd16_gemv_rows(const MicroscaledLayout& w, const Decode& decode, const float* xp,
                             int64_t m, float* op, int64_t begin, int64_t end) {
  for (int64_t r0 = 0; r0 < m; r0 += 8) {
    const float* x = xp + r0 * w.k;
    float* o = op + r0 * w.n;
    switch (std::min<int64_t>(8, m - r0)) {
      case 1: simd16_gemv_chunk<1>(w, decode, x, o, begin, end); break;
      case 2: simd16_gemv_chunk<2>(w, decode, x, o, begin, end); break;
      case 3: simd16_gemv_chunk<3>(w, decode, x, o, begin, end); break;
      case 4: simd16_gemv_chunk<4>(w, decode, x, o, begin, end); break;
      case 5: simd16_gemv_chunk<5>(w, decode, x, o, begin, end); break;
      case 6: simd16_gemv_chunk<6>(w, decode, x, o, begin, end); break;
      case 7: simd16_gemv_chunk<7>(w, decode, x, o, begin, end); break;
      default: simd16_gemv_chunk<8>(w, decode, x, o, begin, end); break;
    }
  }
}

#if defined(__AVX512BF16__)
// 32 4-bit codes of a bfloat16 table (MXFP4's and NVFP4's e2m1) as bf16, in input order: a
// byte's low nibble is input 2i, its high one 2i + 1, 16-bit lanes 2i and 2i + 1 (vpermw).
struct NibbleBf16 {
  const uint8_t* codes;
  int64_t k;
  __m512i table;  // the 16 values' bf16 bits in the low 16 lanes
  static constexpr float rescale = 1.f;
  __m512bh operator()(int64_t n, int64_t j) const {
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + n * (k / 2) + j / 2)));
    const __m512i index = _mm512_or_si512(
        _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)),
        _mm512_slli_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF0)), 12));
    return (__m512bh)_mm512_permutexvar_epi16(index, table);
  }
};

// 32 float8_e4m3fn bytes (MXFP8, FP8 checkpoints) as bf16 times 2^-8: decode16_e4m3's floats,
// exact in bf16 (three mantissa bits).
struct E4m3Bf16 {
  const uint8_t* codes;
  int64_t k;
  static constexpr float rescale = kE4m3Rescale;
  __m512bh operator()(int64_t n, int64_t j) const {
    const uint8_t* c = codes + n * k + j;
    return _mm512_cvtne2ps_pbh(decode16_e4m3(c + 16), decode16_e4m3(c));
  }
};

// Codes exact in bf16 times bf16 activations: each 32 codes decoded once into bf16 and dotted
// with each row's 32 inputs by one vdpbf16ps (the products exact in float32, their sums in
// float32): half the instructions of the float32 path a row of x, or fewer. Output lanes 0-7
// hold inputs 0-15's sums, lanes 8-15 inputs 16-31's, so blocks of 16 (NVFP4) take a scale per
// half; larger blocks (32 and up, FP8's whole rows) sum their runs first, then scale once. K a
// multiple of 32.
template <int R, bool kBlocksOf16, typename Decode>
inline void bf16_gemv_chunk(const MicroscaledLayout& w, const Decode& decode, const uint16_t* x0,
                            float* o0, int64_t begin, int64_t end) {
  const int64_t run = kBlocksOf16 ? 32 : w.block;  // inputs between scalings
  for (int64_t n = begin; n < end; ++n) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t first = 0; first < w.k; first += run) {
      __m512 part[R];
      for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_ps();
      for (int64_t j = first; j < first + run; j += 32) {
        const __m512bh v = decode(n, j);
        for (int r = 0; r < R; ++r)
          part[r] = _mm512_dpbf16_ps(part[r], v, (__m512bh)_mm512_loadu_si512(x0 + r * w.k + j));
      }
      __m512 s = _mm512_set1_ps(Decode::rescale * w.scale(n, first / w.block));
      if constexpr (kBlocksOf16)
        s = _mm512_mask_blend_ps(
            0xFF00, s, _mm512_set1_ps(Decode::rescale * w.scale(n, first / w.block + 1)));
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(part[r], s, acc[r]);
    }
    for (int r = 0; r < R; ++r) o0[r * w.n + n] = _mm512_reduce_add_ps(acc[r]);
  }
}

template <bool kBlocksOf16, typename Decode>
inline void bf16_gemv_rows_of(const MicroscaledLayout& w, const Decode& decode,
                              const uint16_t* xp, int64_t m, float* op, int64_t begin,
                              int64_t end) {
  for (int64_t r0 = 0; r0 < m; r0 += 8) {
    const uint16_t* x = xp + r0 * w.k;
    float* o = op + r0 * w.n;
    switch (std::min<int64_t>(8, m - r0)) {
      case 1: bf16_gemv_chunk<1, kBlocksOf16>(w, decode, x, o, begin, end); break;
      case 2: bf16_gemv_chunk<2, kBlocksOf16>(w, decode, x, o, begin, end); break;
      case 3: bf16_gemv_chunk<3, kBlocksOf16>(w, decode, x, o, begin, end); break;
      case 4: bf16_gemv_chunk<4, kBlocksOf16>(w, decode, x, o, begin, end); break;
      case 5: bf16_gemv_chunk<5, kBlocksOf16>(w, decode, x, o, begin, end); break;
      case 6: bf16_gemv_chunk<6, kBlocksOf16>(w, decode, x, o, begin, end); break;
      case 7: bf16_gemv_chunk<7, kBlocksOf16>(w, decode, x, o, begin, end); break;
      default: bf16_gemv_chunk<8, kBlocksOf16>(w, decode, x, o, begin, end); break;
    }
  }
}

// Whether bf16_gemv_rows takes w: codes exact in bf16 (a bf16 4-bit table, or e4m3), K a
// multiple of 32, blocks of 16 or of a multiple of 32.
inline bool bf16_gemv_takes(const MicroscaledLayout& w) {
  return (w.bf16_table || w.e4m3) && w.k % 32 == 0 && (w.block == 16 || w.block % 32 == 0);
}

inline void bf16_gemv_rows(const MicroscaledLayout& w, const uint16_t* xp, int64_t m, float* op,
                           int64_t begin, int64_t end) {
  const auto run = [&](const auto& decode) {
    if (w.block == 16)
      bf16_gemv_rows_of<true>(w, decode, xp, m, op, begin, end);
    else
      bf16_gemv_rows_of<false>(w, decode, xp, m, op, begin, end);
  };
  if (w.e4m3) {
    run(E4m3Bf16{w.codes, w.k});
    return;
  }
  alignas(64) uint16_t entries[32] = {};
  for (int i = 0; i < 16; ++i) {
    uint32_t u;
    std::memcpy(&u, &w.code_lut[i], 4);
    entries[i] = static_cast<uint16_t>(u >> 16);
  }
  run(NibbleBf16{w.codes, w.k, _mm512_load_si512(entries)});
}
#endif

// Row n's block b, scaled, into dst.
template <typename Decode>
inline void dequantize16_block(const MicroscaledLayout& w, const Decode& decode, int64_t n,
                               int64_t b, float* dst) {
  const __m512 s = _mm512_set1_ps(Decode::rescale * w.scale(n, b));
  for (int64_t j = 0; j < w.block; j += 16)
    _mm512_storeu_ps(dst + j, _mm512_mul_ps(decode(n, b * w.block + j), s));
}
#endif

}  // namespace
