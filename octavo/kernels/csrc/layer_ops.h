// The elementwise layers of a step: RMSNorm (plain and Gemma's 1 + w, and with a residual add),
// rotary embedding, RoPE with the KV write, SiLU-and-mul and GELU(tanh)-and-mul.
// Included by both translation units (cpu_ops.cpp, decode_stack.cpp): each compiles what it
// calls.
#pragma once

#include "simd.h"

namespace {

#if defined(__AVX512F__)
// 1 / rms(x) of a row (width a multiple of 16) in every lane.
template <typename T>
inline __m512 inv_rms16(const T* xr, int64_t width, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < width; i += 16) {
    const __m512 v = load16(xr + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / width + eps));
}
#endif

// One row of RMSNorm; the residual-add variant below calls it too, so both round alike.
template <typename T>
inline void rms_norm_row(const T* xr, const T* wp, T* orow, int64_t width, float eps) {
#if defined(__AVX512F__)
  if constexpr (kVec16<T>) {
    if (width % 16 == 0) {
      const __m512 inv = inv_rms16(xr, width, eps);
      for (int64_t i = 0; i < width; i += 16)
        store16(orow + i, _mm512_mul_ps(round16<T>(_mm512_mul_ps(load16(xr + i), inv)),
                                        load16(wp + i)));
      return;
    }
  }
#endif
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < width; ++i) sq += to_f(xr[i]) * to_f(xr[i]);
  const float inv = 1.f / std::sqrt(sq / width + eps);
  // The normalized value is rounded to the input dtype before the weight is applied, as
  // the reference implementations do.
  for (int64_t i = 0; i < width; ++i)
    orow[i] = static_cast<T>(to_f(static_cast<T>(to_f(xr[i]) * inv)) * to_f(wp[i]));
}

// Gemma's RMSNorm row (octavo/model/layers/norm.py GemmaRMSNorm): the weight is 1 + w, in
// float32, and the normalized value is not rounded before it is applied; one rounding at the end.
template <typename T>
inline void one_plus_norm_row(const T* xr, const float* w1, T* orow, int64_t width, float eps) {
#if defined(__AVX512F__)
  if constexpr (kVec16<T>) {
    if (width % 16 == 0) {
      const __m512 inv = inv_rms16(xr, width, eps);
      for (int64_t i = 0; i < width; i += 16)
        store16(orow + i, _mm512_mul_ps(_mm512_mul_ps(load16(xr + i), inv),
                                        _mm512_loadu_ps(w1 + i)));
      return;
    }
  }
#endif
  float sq = 0.f;
#pragma omp simd reduction(+ : sq)
  for (int64_t i = 0; i < width; ++i) sq += to_f(xr[i]) * to_f(xr[i]);
  const float inv = 1.f / std::sqrt(sq / width + eps);
  for (int64_t i = 0; i < width; ++i) orow[i] = static_cast<T>(to_f(xr[i]) * inv * w1[i]);
}

// A norm's weight as the decode stack holds it: w itself in T (RMSNorm), or 1 + w in float32
// (Gemma); neither set: no norm.
template <typename T>
struct NormWeight {
  const T* w = nullptr;
  const float* one_plus = nullptr;
  bool defined() const { return w != nullptr || one_plus != nullptr; }
};

template <typename T>
inline void norm_row(const NormWeight<T>& n, const T* xr, T* orow, int64_t width, float eps) {
  if (n.one_plus != nullptr)
    one_plus_norm_row(xr, n.one_plus, orow, width, eps);
  else
    rms_norm_row(xr, n.w, orow, width, eps);
}

// Gemma's RMSNorm over rows: `plus_one` is 1 + w in float32.
template <typename T>
void one_plus_rms_norm_typed(at::Tensor& out, const at::Tensor& x, const at::Tensor& plus_one,
                             double eps) {
  const int64_t rows = x.size(0), width = x.size(1);
  const T* xp = x.data_ptr<T>();
  const float* wp = plus_one.data_ptr<float>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      one_plus_norm_row(xp + r * width, wp, op + r * width, width, static_cast<float>(eps));
  });
}

template <typename T>
void rms_norm_typed(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                    double eps) {
  const int64_t rows = x.size(0), width = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = weight.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rms_norm_row(xp + r * width, wp, op + r * width, width, static_cast<float>(eps));
  });
}

// Rotate-half RoPE of one head in place.
template <typename T>
inline void rotate_half(T* v, const float* c, const float* s, int64_t half) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (kVec16<T>) {
    for (; i + 16 <= half; i += 16) {
      const __m512 a = load16(v + i), b = load16(v + i + half);
      const __m512 cv = _mm512_loadu_ps(c + i), sv = _mm512_loadu_ps(s + i);
      store16(v + i, _mm512_fmsub_ps(a, cv, _mm512_mul_ps(b, sv)));
      store16(v + i + half, _mm512_fmadd_ps(b, cv, _mm512_mul_ps(a, sv)));
    }
  }
#endif
  for (; i < half; ++i) {
    const float a = to_f(v[i]), b = to_f(v[i + half]);
    v[i] = static_cast<T>(a * c[i] - b * s[i]);
    v[i + half] = static_cast<T>(b * c[i] + a * s[i]);
  }
}

// Rotate-half RoPE applied in place to x [T, heads, dim] (any strides with a unit last stride).
template <typename T>
void rotary_typed(at::Tensor& x, const int64_t* pos, const float* cos, const float* sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  T* xp = x.data_ptr<T>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * half;
      const float* s = sin + pos[t] * half;
      for (int64_t h = 0; h < heads; ++h) rotate_half(xp + t * s0 + h * s1, c, s, half);
    }
  });
}

// A decoder layer's residual add and the norm after it in one pass: x += delta (rounded to T, as
// x + delta is), then out = rms_norm(x) with the rounding of rms_norm_typed. x is [rows, width]
// contiguous; delta's rows are `delta_stride` apart (a narrowed projection output).
template <typename T>
void add_rms_norm_typed(T* x, const T* delta, int64_t delta_stride, NormWeight<T> weight, T* out,
                        int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * width;
      const T* dr = delta + r * delta_stride;
      int64_t i = 0;
#if defined(__AVX512F__)
      if constexpr (kVec16<T>)
        for (; i + 16 <= width; i += 16) store16(xr + i, _mm512_add_ps(load16(xr + i), load16(dr + i)));
#endif
      for (; i < width; ++i) xr[i] = static_cast<T>(to_f(xr[i]) + to_f(dr[i]));
      norm_row(weight, xr, out + r * width, width, eps);
    }
  });
}

// The q and k heads of a fused qkv row normed (the q_norm / k_norm of Qwen3 and Gemma 3 per
// head, or of OLMo 2 over all of the token's q and all of its k heads where `whole_norm`, when
// given) and rotated in place, and the k and v rows written to their cache slots: what rms_norm,
// rotary_typed and write_rows do, without a tensor view per head group. qkv rows are `stride`
// apart; the cache is T, like the activations (null caches: the caller writes them, an fp8
// cache). The rotation covers a head's first 2 * half features (half = dim / 2, or less for
// partial rotary: the rest pass through).
template <typename T>
void rope_write_kv_typed(T* qkv, int64_t tokens, int64_t stride, int64_t heads, int64_t kv_heads,
                         int64_t dim, int64_t half, const int64_t* pos, const float* cos,
                         const float* sin, NormWeight<T> q_norm, NormWeight<T> k_norm,
                         bool whole_norm, float eps, T* k_cache, T* v_cache,
                         const int64_t* slots) {
  const int64_t kv_width = kv_heads * dim;
  // A prefill's thousands of tokens are split between the threads; a decode step's few run
  // inline (no fork).
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * stride;
      const float* c = cos + pos[t] * half;
      const float* s = sin + pos[t] * half;
      if (whole_norm) {  // norm_row reads a row whole before it writes: in place is safe
        if (q_norm.defined()) norm_row(q_norm, row, row, heads * dim, eps);
        if (k_norm.defined()) norm_row(k_norm, row + heads * dim, row + heads * dim, kv_width, eps);
      }
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        T* head = row + h * dim;
        const NormWeight<T>& norm = h < heads ? q_norm : k_norm;
        if (norm.defined() && !whole_norm) norm_row(norm, head, head, dim, eps);
        rotate_half(head, c, s, half);
      }
      if (k_cache == nullptr) continue;
      std::copy(row + heads * dim, row + heads * dim + kv_width, k_cache + slots[t] * kv_width);
      std::copy(row + heads * dim + kv_width, row + heads * dim + 2 * kv_width,
                v_cache + slots[t] * kv_width);
    }
  });
}

#if defined(__AVX512F__)

// silu(gate) * up for 16 lanes, silu rounded to T first; T is float or bfloat16.
template <typename T>
inline void silu_mul16(const T* gate, const T* up, T* out) {
  const __m512 g = load16(gate);
  // g / (1 + e^-g) with a refined reciprocal (about 2^-28 relative) instead of a division,
  // whose 512-bit form is slow on this class of CPU. Below g = -80 silu is below 1e-33: 0 here
  // (e^-g is capped so that the reciprocal stays finite).
  const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), g);
  const __mmask16 live = _mm512_cmp_ps_mask(neg, _mm512_set1_ps(80.f), _CMP_LE_OQ);
  const __m512 den =
      _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_min_ps(neg, _mm512_set1_ps(80.f))));
  __m512 inv = _mm512_rcp14_ps(den);
  inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
  const __m512 act = _mm512_maskz_mul_ps(live, g, inv);
  store16(out, _mm512_mul_ps(round16<T>(act), load16(up)));
}
#endif

template <typename T>
void silu_and_mul_typed(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), width = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // A decode step's few rows are a few microseconds of work: one thread, no fork.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * 2 * width;
      const T* up = gate + width;
      T* o = op + r * width;
      int64_t i = 0;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>)
        for (; i + 16 <= width; i += 16) silu_mul16(gate + i, up + i, o + i);
#elif defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, float>)  // std::exp a lane cost 0.9 ms a SmolLM2 step
        for (; i + 8 <= width; i += 8) {
          // As silu_mul16: below g = -80 silu is below 1e-33, 0 here.
          const __m256 g = _mm256_loadu_ps(gate + i);
          const __m256 neg = _mm256_sub_ps(_mm256_setzero_ps(), g);
          const __m256 live = _mm256_cmp_ps(neg, _mm256_set1_ps(80.f), _CMP_LE_OQ);
          const __m256 act = _mm256_and_ps(
              live, _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(neg))));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(act, _mm256_loadu_ps(up + i)));
        }
#endif
      for (; i < width; ++i) {
        const float g = to_f(gate[i]);
        // silu is rounded to the input dtype before the product, as in F.silu(gate) * up.
        const float act = to_f(static_cast<T>(g / (1.f + std::exp(-g))));
        o[i] = static_cast<T>(act * to_f(up[i]));
      }
    }
  });
}

// gelu(gate, approximate="tanh") * up of a packed [T, 2 * width] row block (Gemma's GeGLU).
// 0.5 g (1 + tanh(u)) is g / (1 + e^(-2u)), u = sqrt(2 / pi) (g + 0.044715 g^3): the form of silu
// with 2u for g, which keeps its accuracy near 0 (no 1 - 1 cancellation) and needs one exp.
// gelu is rounded to T before the product, as in F.gelu(gate) * up.
template <typename T>
void gelu_tanh_and_mul_typed(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), width = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  constexpr float kTwoBeta = 2.f * 0.7978845608028654f, kKappa = 0.044715f;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * 2 * width;
      const T* up = gate + width;
      T* o = op + r * width;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
      if constexpr (std::is_same_v<T, float>)
        for (; i + 8 <= width; i += 8) {
          const __m256 g = _mm256_loadu_ps(gate + i);
          const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
          // -2u, capped at 80 as silu's exponent is: beyond it gelu is below 1e-33, 0 here.
          const __m256 neg = _mm256_mul_ps(_mm256_set1_ps(-kTwoBeta),
                                           _mm256_fmadd_ps(_mm256_set1_ps(kKappa), g3, g));
          const __m256 live = _mm256_cmp_ps(neg, _mm256_set1_ps(80.f), _CMP_LE_OQ);
          const __m256 act = _mm256_and_ps(
              live, _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(neg))));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(act, _mm256_loadu_ps(up + i)));
        }
#endif
      for (; i < width; ++i) {
        const float g = to_f(gate[i]);
        const float neg = -kTwoBeta * (g + kKappa * g * g * g);
        const float act = neg > 80.f ? 0.f : to_f(static_cast<T>(g / (1.f + std::exp(neg))));
        o[i] = static_cast<T>(act * to_f(up[i]));
      }
    }
  });
}

}  // namespace
