// LoRA deltas of a few tokens (decode steps, short chunks): y[row] += B (A x[row]) for one
// adapter's rows, reading A and B once for all of them (octavo/model/layers/lora.py). A is
// [packed * rank, K] (each packed projection's A stacked), B is stored transposed, [rank, N],
// with output columns [bounds[j], bounds[j + 1]) belonging to packed projection j, which reads
// A x's entries [j * rank, (j + 1) * rank): so the expansion is rank scaled rows of B^T added
// along N, which vectorizes. A x and B A x are kept in float32 and y rounded once. More rows
// than kLoraKernelRows go through two GEMMs instead (lora_apply below, and the Python side's
// own).
// Included by cpu_ops.cpp only, after simd.h (ops.h declares lora_apply for DecodeStack).
#pragma once

#include <ATen/record_function.h>

constexpr int64_t kLoraKernelRows = 16;

// Element c of a row as float32: bf16 widened by a shift, which vectorizes in the loops below.
template <typename T>
inline float lora_f(const T* p, int64_t c) { return static_cast<float>(p[c]); }

template <>
inline float lora_f<c10::BFloat16>(const c10::BFloat16* p, int64_t c) {
  const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[c]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// v rounded to T at p[c]: bf16 rounded to nearest even with integer ops, which vectorize
// where c10::BFloat16's conversion does not (the sums here are finite).
template <typename T>
inline void lora_store(T* p, int64_t c, float v) { p[c] = static_cast<T>(v); }

template <>
inline void lora_store<c10::BFloat16>(c10::BFloat16* p, int64_t c, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  reinterpret_cast<uint16_t*>(p)[c] = static_cast<uint16_t>(bits >> 16);
}

constexpr int64_t kLoraAhead = 8;  // rows of A prefetched ahead of the four being summed
constexpr int64_t kLoraBlock = 64;  // outputs whose sums stay in registers: four AVX-512 ones

// Sixteen float32 lanes (GCC's vector extension: one AVX-512 register, two AVX2 ones), so that
// a block's sums stay in registers across B^T's rows; an array of them spills to the stack.
typedef float LoraVec __attribute__((vector_size(64)));
typedef uint32_t LoraVecBits __attribute__((vector_size(64)));
typedef uint16_t LoraVecHalf __attribute__((vector_size(32)));

// p[0:16] as float32.
template <typename B>
inline LoraVec lora_load16(const B* p) {
  LoraVec v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}

template <>
inline LoraVec lora_load16<float>(const float* p) {
  LoraVec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <>
inline LoraVec lora_load16<c10::BFloat16>(const c10::BFloat16* p) {
  LoraVecHalf h;
  std::memcpy(&h, p, sizeof h);
  const LoraVecBits bits = __builtin_convertvector(h, LoraVecBits) << 16;
  LoraVec v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// y[0:len] += sum over r of t[r] * bt[r * stride + n]: the sum in float32 from zero, in r's
// order, then one rounding into y. bt: the model's dtype, or float32 (a block widened once
// for several rows).
template <typename T, typename B>
inline void lora_expand_block(T* y, const B* bt, int64_t stride, const float* t, int64_t rank,
                              int64_t len) {
  float acc[kLoraBlock] = {};
  if (len == kLoraBlock) {
    static_assert(kLoraBlock == 64, "four vectors of sums");
    LoraVec s0 = {}, s1 = {}, s2 = {}, s3 = {};
    for (int64_t r = 0; r < rank; ++r) {
      const B* br = bt + r * stride;
      const LoraVec scale = LoraVec{} + t[r];
      s0 += lora_load16(br) * scale;
      s1 += lora_load16(br + 16) * scale;
      s2 += lora_load16(br + 32) * scale;
      s3 += lora_load16(br + 48) * scale;
    }
    std::memcpy(acc, &s0, sizeof s0);
    std::memcpy(acc + 16, &s1, sizeof s1);
    std::memcpy(acc + 32, &s2, sizeof s2);
    std::memcpy(acc + 48, &s3, sizeof s3);
  } else {
    for (int64_t r = 0; r < rank; ++r) {
      const B* br = bt + r * stride;
      const float scale = t[r];
#pragma omp simd
      for (int64_t n = 0; n < len; ++n) acc[n] += lora_f(br, n) * scale;
    }
  }
#pragma omp simd
  for (int64_t n = 0; n < len; ++n) lora_store(y, n, lora_f(y, n) + acc[n]);
}

// One adapter slot's few rows of a step: y[rows[i]] += B (A x[rows[i]]).
template <typename T>
struct LoraRows {
  const T* x;
  int64_t x_stride;
  T* y;
  int64_t y_stride;
  const int64_t* rows;
  int64_t count;
  const T* a;   // [packed * rank, k]
  const T* bt;  // [rank, n_out]
  const int64_t* bounds;
  int64_t packed, rank, k;

  int64_t width() const { return packed * rank; }
  int64_t n_out() const { return bounds[packed]; }

  // t[i, w] = A[w] . x[rows[i]]: four rows of A at a time against each row of x (xf: x's rows
  // widened). For several rows the four are widened once, not once per row.
  void shrink(const float* xf, float* t) const {
    const int64_t w_end = width();
    std::vector<float> af(count > 1 ? 4 * k : 0);
    for (int64_t w = 0; w < w_end; w += 4) {
      const int64_t m = std::min<int64_t>(4, w_end - w);
      if (w + kLoraAhead < w_end)  // the rows two groups on, while these are summed
        prefetch_lines(a + (w + kLoraAhead) * k, std::min<int64_t>(4, w_end - w - kLoraAhead) *
                       k * static_cast<int64_t>(sizeof(T)), false);
      if (count == 1) {
        dot4(a + w * k, m, xf, t + w);
        continue;
      }
      widen(a + w * k, af.data(), m * k);
      for (int64_t i = 0; i < count; ++i) dot4(af.data(), m, xf + i * k, t + i * width() + w);
    }
  }

  // out[q] = rows[q] . xi for the m (<= 4) consecutive rows of k elements at rows.
  template <typename P>
  void dot4(const P* rows4, int64_t m, const float* xi, float* out) const {
    const P* a0 = rows4;
    const P* a1 = rows4 + (m > 1) * k;
    const P* a2 = rows4 + (m > 2) * 2 * k;
    const P* a3 = rows4 + (m > 3) * 3 * k;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t c = 0; c < k; ++c) {
      s0 += lora_f(a0, c) * xi[c];
      s1 += lora_f(a1, c) * xi[c];
      s2 += lora_f(a2, c) * xi[c];
      s3 += lora_f(a3, c) * xi[c];
    }
    const float sums[4] = {s0, s1, s2, s3};
    for (int64_t q = 0; q < m; ++q) out[q] = sums[q];
  }

  // The output blocks of the expansion: (packed projection, first column), kLoraBlock wide.
  std::vector<std::pair<int64_t, int64_t>> blocks() const {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (int64_t j = 0; j < packed; ++j)
      for (int64_t n0 = bounds[j]; n0 < bounds[j + 1]; n0 += kLoraBlock) out.emplace_back(j, n0);
    return out;
  }

  // y += B t over one block of outputs, for every row (several: the block widened once into
  // bf, [rank, kLoraBlock]).
  void expand(const float* t, int64_t j, int64_t n0, float* bf) const {
    const int64_t len = std::min<int64_t>(kLoraBlock, bounds[j + 1] - n0);
    // B^T's rows are read kLoraBlock columns at a time, rank strided streams the hardware
    // prefetcher does not follow: ask for two blocks on
    if (n0 + 2 * kLoraBlock < bounds[j + 1])
      for (int64_t r = 0; r < rank; ++r)
        prefetch_lines(bt + r * n_out() + n0 + 2 * kLoraBlock,
                       kLoraBlock * static_cast<int64_t>(sizeof(T)), false);
    if (count == 1) {
      expand_rows(t, j, bt + n0, n_out(), len, n0);
      return;
    }
    for (int64_t r = 0; r < rank; ++r) widen(bt + r * n_out() + n0, bf + r * len, len);
    expand_rows(t, j, bf, len, len, n0);
  }

  template <typename B>
  void expand_rows(const float* t, int64_t j, const B* block, int64_t stride, int64_t len,
                   int64_t n0) const {
    for (int64_t i = 0; i < count; ++i) {
      const float* ti = t + i * width() + j * rank;
      T* yi = y + rows[i] * y_stride + n0;
      lora_expand_block(yi, block, stride, ti, rank, len);
    }
  }

  // Both steps, on this thread: its core's caches hold the slot StackLinear prefetched (a
  // second core would read it from this one's: shared among the threads, a decode step with
  // one adapter was no faster on AMD EPYC Zen 4, docs/performance.md "LoRA adapters").
  void run() const {
    std::vector<float> xf(count * k), t(count * width());
    std::vector<float> bf(count > 1 ? rank * kLoraBlock : 0);
    for (int64_t i = 0; i < count; ++i) widen(x + rows[i] * x_stride, xf.data() + i * k, k);
    shrink(xf.data(), t.data());
    for (const auto& [j, n0] : blocks()) expand(t.data(), j, n0, bf.data());
  }
};

// y[rows[i], lo:lo + width] += delta[i] for each of delta's rows (index_add_ and a narrowed
// add_ cost more than the GEMMs they follow).
template <typename T>
void lora_add_rows(at::Tensor& y, const at::Tensor& delta, int64_t lo, const int64_t* rows,
                   int64_t count) {
  const int64_t width = delta.size(1), y_stride = y.stride(0);
  const T* d = delta.data_ptr<T>();
  T* out = y.data_ptr<T>() + lo;
  at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* yi = out + rows[i] * y_stride;
      const T* di = d + i * width;
#pragma omp simd
      for (int64_t n = 0; n < width; ++n)
        lora_store(yi, n, lora_f(yi, n) + lora_f(di, n));
    }
  });
}

// Ask for slot `slot`'s A and B before the base product that precedes their delta, so that
// they arrive while it streams the layer's weights (read cold, they cost more than their
// arithmetic).
void lora_prefetch(const at::Tensor& a, const at::Tensor& b, int64_t slot) {
  prefetch_lines(static_cast<const char*>(a.data_ptr()) + slot * a.stride(0) * a.element_size(),
                 a.stride(0) * a.element_size(), false);
  prefetch_lines(static_cast<const char*>(b.data_ptr()) + slot * b.stride(0) * b.element_size(),
                 b.stride(0) * b.element_size(), false);
}

// The rows of x each adapter slot takes (token_slot[t]: row t's slot, -1 for none), for the
// slots whose adapter targets this layer (used).
inline std::vector<std::vector<int64_t>> lora_rows_by_slot(const at::Tensor& token_slot,
                                                           const at::Tensor& used) {
  TORCH_CHECK(token_slot.scalar_type() == at::kLong && token_slot.is_contiguous() &&
              used.scalar_type() == at::kBool, "token_slot: int64 [T]; used: bool [slots]");
  const int64_t* ts = token_slot.data_ptr<int64_t>();
  const bool* u = used.data_ptr<bool>();
  std::vector<std::vector<int64_t>> rows(used.size(0));
  for (int64_t t = 0; t < token_slot.size(0); ++t) {
    const int64_t s = ts[t];
    TORCH_CHECK(s < used.size(0), "token_slot names slot ", s, " of ", used.size(0));
    if (s >= 0 && u[s]) rows[s].push_back(t);
  }
  return rows;
}

// y += each row's adapter delta (a [slots, packed * rank, K], bt [slots, rank, N]): per slot in
// the step, its rows in one pass over its A and B (a few rows, the slots side by side on the
// cores) or two GEMMs (more rows): the punica/SGMV grouping, one call per layer.
void lora_apply(at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
                const at::Tensor& b, const std::vector<int64_t>& bounds,
                const at::Tensor& used, const at::Tensor& token_slot) {
  RECORD_FUNCTION("octavo::lora_apply", std::vector<c10::IValue>());
  const int64_t packed = static_cast<int64_t>(bounds.size()) - 1;
  const int64_t rank = b.size(1), k = a.size(2);
  TORCH_CHECK(packed >= 1 && a.size(1) == packed * rank && b.size(2) == bounds.back() &&
              x.size(1) == k && y.size(1) == bounds.back() && a.size(0) == used.size(0) &&
              token_slot.size(0) == x.size(0), "LoRA shapes do not agree: y ", y.sizes(),
              ", x ", x.sizes(), ", A ", a.sizes(), ", B^T ", b.sizes(), ", ", packed,
              " packed projections, used ", used.sizes(), ", token_slot ", token_slot.sizes());
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1 && a.is_contiguous() && b.is_contiguous() &&
              x.scalar_type() == a.scalar_type() && y.scalar_type() == a.scalar_type() &&
              b.scalar_type() == a.scalar_type(), "LoRA tensors: contiguous rows, one dtype");
  const auto rows = lora_rows_by_slot(token_slot, used);
  std::vector<int64_t> few, many;
  for (int64_t s = 0; s < static_cast<int64_t>(rows.size()); ++s) {
    if (rows[s].empty()) continue;
    (static_cast<int64_t>(rows[s].size()) > kLoraKernelRows ? many : few).push_back(s);
  }
  for (int64_t s : many) {  // GEMMs: LoRASlots.add_delta's large-batch ops
    const auto index = at::tensor(rows[s], token_slot.options());
    const auto t = at::matmul(x.index_select(0, index), a[s].t());
    for (int64_t j = 0; j < packed; ++j) {
      const auto cols = b[s].narrow(1, bounds[j], bounds[j + 1] - bounds[j]);
      const auto delta = at::matmul(t.narrow(1, j * rank, rank), cols).contiguous();
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "lora_add",
                                      [&] { lora_add_rows<scalar_t>(y, delta, bounds[j],
                                                                    rows[s].data(),
                                                                    delta.size(0)); });
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "lora_apply", [&] {
    auto slot = [&](int64_t s) {
      return LoraRows<scalar_t>{x.data_ptr<scalar_t>(), x.stride(0), y.data_ptr<scalar_t>(),
                                y.stride(0), rows[s].data(),
                                static_cast<int64_t>(rows[s].size()),
                                a.data_ptr<scalar_t>() + s * a.stride(0),
                                b.data_ptr<scalar_t>() + s * b.stride(0), bounds.data(), packed,
                                rank, k};
    };
    if (few.size() == 1) {
      slot(few[0]).run();  // on this thread, whose caches hold the prefetched slot
    } else {  // the slots side by side on the cores
      at::parallel_for(0, static_cast<int64_t>(few.size()), 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) slot(few[i]).run();
      });
    }
  });
}
