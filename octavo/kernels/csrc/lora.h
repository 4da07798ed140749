// LoRA deltas of a few tokens (decode steps, short chunks): y[row] += B (A x[row]) for one
// adapter's rows, reading A and B once for all of them (octavo/model/layers/lora.py). A is
// [packed * rank, K] (each packed projection's A stacked), B is stored transposed, [rank, N],
// with output columns [bounds[j], bounds[j + 1]) belonging to packed projection j, which reads
// A x's entries [j * rank, (j + 1) * rank): so the expansion is rank scaled rows of B^T added
// along N, which vectorizes. A x and B A x are kept in float32 and y rounded once. The work is
// a few hundred thousand multiply-adds: one thread does it sooner than two can be woken. More
// rows than kLoraKernelRows go through two GEMMs instead (lora_delta below, and the Python
// side's own).
// Included by cpu_ops.cpp only, after simd.h.
#pragma once

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

template <typename T>
void lora_rows_typed(const T* x, int64_t x_stride, T* y, int64_t y_stride, const int64_t* index,
                     int64_t first, int64_t count, const T* a, const T* bt,
                     const int64_t* bounds, int64_t packed, int64_t rank, int64_t k) {
  const int64_t width = packed * rank, n_out = bounds[packed];
  auto row = [&](int64_t i) { return index ? index[i] : first + i; };
  thread_local std::vector<float> xf, t, acc;
  xf.resize(count * k);
  t.resize(count * width);
  acc.assign(count * n_out, 0.f);
  for (int64_t i = 0; i < count; ++i) widen(x + row(i) * x_stride, xf.data() + i * k, k);
  // t = A x: four rows of A at a time against each token
  for (int64_t w = 0; w < width; w += 4) {
    const int64_t m = std::min<int64_t>(4, width - w);
    const T* a0 = a + w * k;
    const T* a1 = a + (w + (m > 1)) * k;
    const T* a2 = a + (w + (m > 2) * 2) * k;
    const T* a3 = a + (w + (m > 3) * 3) * k;
    for (int64_t i = 0; i < count; ++i) {
      const float* xi = xf.data() + i * k;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t c = 0; c < k; ++c) {
        s0 += lora_f(a0, c) * xi[c];
        s1 += lora_f(a1, c) * xi[c];
        s2 += lora_f(a2, c) * xi[c];
        s3 += lora_f(a3, c) * xi[c];
      }
      const float sums[4] = {s0, s1, s2, s3};
      for (int64_t q = 0; q < m; ++q) t[i * width + w + q] = sums[q];
    }
  }
  // acc = B t: B^T's rows (one per rank) scaled by t and summed along each projection's outputs
  for (int64_t j = 0; j < packed; ++j) {
    const int64_t lo = bounds[j], hi = bounds[j + 1];
    for (int64_t i = 0; i < count; ++i) {
      const float* ti = t.data() + i * width + j * rank;
      float* out = acc.data() + i * n_out;
      for (int64_t r = 0; r < rank; ++r) {
        const T* br = bt + r * n_out;
        const float tr = ti[r];
#pragma omp simd
        for (int64_t n = lo; n < hi; ++n) out[n] += lora_f(br, n) * tr;
      }
    }
  }
  for (int64_t i = 0; i < count; ++i) {
    T* yi = y + row(i) * y_stride;
    const float* ai = acc.data() + i * n_out;
#pragma omp simd
    for (int64_t n = 0; n < n_out; ++n) lora_store(yi, n, lora_f(yi, n) + ai[n]);
  }
}

// y[row(i), lo:lo + width] += delta[i] for each of delta's rows (index_add_ and a narrowed
// add_ cost more than the GEMMs they follow).
template <typename T>
void lora_add_rows(at::Tensor& y, const at::Tensor& delta, int64_t lo, const int64_t* index,
                   int64_t first, int64_t count) {
  const int64_t width = delta.size(1), y_stride = y.stride(0);
  const T* d = delta.data_ptr<T>();
  T* out = y.data_ptr<T>() + lo;
  at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* yi = out + (index ? index[i] : first + i) * y_stride;
      const T* di = d + i * width;
#pragma omp simd
      for (int64_t n = 0; n < width; ++n)
        lora_store(yi, n, lora_f(yi, n) + lora_f(di, n));
    }
  });
}

// y[rows] += the delta of adapter slot `slot` (a [slots, packed * rank, K], bt [slots, rank, N])
// for rows [start, start + length) of x, or the rows in `index`.
inline void lora_delta(at::Tensor& y, const at::Tensor& x, const at::Tensor& a,
                       const at::Tensor& b, const std::vector<int64_t>& bounds, int64_t slot,
                       int64_t start, int64_t length, const std::optional<at::Tensor>& index) {
  const int64_t packed = static_cast<int64_t>(bounds.size()) - 1;
  const int64_t rank = b.size(1), k = a.size(2);
  const int64_t count = index ? index->size(0) : length;
  TORCH_CHECK(packed >= 1 && a.size(1) == packed * rank && b.size(2) == bounds.back() &&
              x.size(1) == k && y.size(1) == bounds.back(), "LoRA shapes do not agree");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1 && a.is_contiguous() && b.is_contiguous() &&
              x.scalar_type() == a.scalar_type() && y.scalar_type() == a.scalar_type() &&
              b.scalar_type() == a.scalar_type(), "LoRA tensors: contiguous rows, one dtype");
  if (count == 0) return;
  const auto idx = index ? index->contiguous() : at::Tensor();
  const int64_t* rows = index ? idx.data_ptr<int64_t>() : nullptr;
  if (count > kLoraKernelRows) {  // GEMMs: LoRASlots.add_delta's large-batch ops
    const auto xs = index ? x.index_select(0, idx) : x.narrow(0, start, length);
    const auto t = at::matmul(xs, a[slot].t());
    for (int64_t j = 0; j < packed; ++j) {
      const auto cols = b[slot].narrow(1, bounds[j], bounds[j + 1] - bounds[j]);
      const auto delta = at::matmul(t.narrow(1, j * rank, rank), cols).contiguous();
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "lora_add",
                                      [&] { lora_add_rows<scalar_t>(y, delta, bounds[j], rows,
                                                                    start, count); });
    }
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "lora_delta", [&] {
    lora_rows_typed<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), y.data_ptr<scalar_t>(),
                              y.stride(0), rows, start,
                              count, a.data_ptr<scalar_t>() + slot * a.stride(0),
                              b.data_ptr<scalar_t>() + slot * b.stride(0), bounds.data(), packed,
                              rank, k);
  });
}
