// How the low-bit GEMVs stream their weights: software prefetch ahead of the reads, activation
// rows widened to float32, and the row count of a call made a template argument.
// Included by cpu_ops.cpp only (the kernels' translation unit), so calls between these files
// inline.
#pragma once

#include "simd.h"

namespace {

// How far ahead of its reads a decode GEMV asks for the weights it streams. A row block of
// int4 weights (16 rows: 4.6 KB for K = 576) or a few int8 rows cross a 4 KB page, where the
// hardware's stream prefetcher stops; on an Intel Xeon (KVM, 2 cores) one core then drew 8 GB/s
// from DRAM. With software prefetches this far ahead, 2 threads stream int4 weights at 17.7 GB/s
// against 11.3 and the int8 LM head at 21.5 against 13.5, and a batch-1 decode step of
// SmolLM2-135M fell from 10.4 to 6.8 ms. 2-6 KB measured alike; 1 KB was slower.
constexpr int64_t kPrefetchBytes = 3072;

// `once`: the call reads these weights in one pass (its rows of x fit one chunk), so they are
// fetched non-temporally. Streaming a model's weights through the caches every decode step
// otherwise evicts the engine's own working set (its Python and numpy code and data) from L2
// and L3, and the step's bookkeeping after the forward runs several times slower (figures in
// docs/performance.md, issue 28's fourth sitting). Weights a call re-reads for later chunks of
// rows keep the temporal hint.
inline void prefetch_lines(const void* p, int64_t bytes, bool once) {
#if defined(__AVX2__)
  const char* c = static_cast<const char*>(p);
  if (once)
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_NTA);
  else
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
#endif
}

template <typename T>
void widen_rows(const at::Tensor& x, std::vector<float>& xf) {
  const int64_t n = x.numel();
  xf.resize(n);
  widen(x.data_ptr<T>(), xf.data(), n);
}

// Runs body<R>() for R = rows (1..8): the row count is a template argument so that the
// accumulators stay in registers.
template <typename F>
void for_rows(int64_t rows, F&& body) {
  switch (rows) {
    case 1: body(std::integral_constant<int, 1>{}); break;
    case 2: body(std::integral_constant<int, 2>{}); break;
    case 3: body(std::integral_constant<int, 3>{}); break;
    case 4: body(std::integral_constant<int, 4>{}); break;
    case 5: body(std::integral_constant<int, 5>{}); break;
    case 6: body(std::integral_constant<int, 6>{}); break;
    case 7: body(std::integral_constant<int, 7>{}); break;
    case 8: body(std::integral_constant<int, 8>{}); break;
    default: TORCH_CHECK(false, "low-bit GEMV takes 1 to 8 rows, got ", rows);
  }
}

}  // namespace
