// Paged attention of a mixed batch: prompt tokens 16 at a time (online softmax over
// bf16 tiles), the split of work items between threads, and the entry that runs both paths.
// Included by cpu_ops.cpp only (the kernels' translation unit), so calls between these files
// inline.
#pragma once

#include "decode_attention.h"

namespace {

// Prompt tokens of one request, up to 16 at a time: lane i of every vector is query i, so each key
// and value row is read once for 16 queries where the per-query path reads it once per query.
// Scores come from vdpbf16ps against the queries' bf16 pairs (exact products summed in float32,
// like the per-query path); the softmax is online (a running peak per query, the sums rescaled
// when it rises), and the values are weighed in float32. Causal: query i (context position
// first_pos + i) sees the keys at positions <= its own, and with a window the latest `window`
// of them.
struct QueryRun {
  int64_t entry;  // the run's first entry of token_index / block_table / seq_lens
  int64_t count;  // its query tokens: consecutive positions over the same blocks
};
constexpr int64_t kRunLanes = 16;
// Runs shorter than this stay with the per-query path, which splits one request's keys between
// threads (a decode, a speculative verification).
constexpr int64_t kMinRun = 16;

#if defined(__AVX512BF16__)
struct PrefillScratch {
  std::vector<uint32_t> qt;  // [group][dim / 2][16]: query i's bf16 pair p at [p][i]
  std::vector<float> o;      // [group][dim][16] weighted sums of values, unnormalized
  std::vector<float> peak, total;  // [group][16]
  std::vector<c10::BFloat16> kt;   // [16][dim] the tile's keys
  std::vector<float> vf;           // [16][dim] the tile's values in float32
  alignas(64) float p[kRunLanes][kRunLanes];  // [key][query] the tile's softmax weights
};

template <int DIM>
void prefill_block(const c10::BFloat16* keys, const c10::BFloat16* values, int64_t row,
                   const int64_t* table, int64_t block_size, const c10::BFloat16* q,
                   int64_t qs0, int64_t qs1, int64_t nq, int64_t first_pos, int64_t group,
                   float scale, float cap, int64_t window, c10::BFloat16* out, int64_t os0,
                   int64_t os1, PrefillScratch& s) {
  constexpr int64_t kPairs = DIM / 2;
  s.qt.assign(group * kPairs * kRunLanes, 0u);  // padding lanes: zero queries
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < nq; ++i) {
      const uint32_t* src = reinterpret_cast<const uint32_t*>(q + i * qs0 + g * qs1);
      for (int64_t p = 0; p < kPairs; ++p) s.qt[(g * kPairs + p) * kRunLanes + i] = src[p];
    }
  s.o.assign(group * DIM * kRunLanes, 0.f);
  // A finite floor for the running peaks: a query that sees no key of a tile (a window's
  // first tile) keeps a rescale of 1 and sums of 0 instead of inf - inf.
  s.peak.assign(group * kRunLanes, -1e30f);
  s.total.assign(group * kRunLanes, 0.f);
  s.kt.resize(kRunLanes * DIM);
  s.vf.resize(kRunLanes * DIM);
  const int64_t last_pos = first_pos + nq - 1;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // Padding lanes repeat the last query's position: finite scores, never written out.
  const __m512i qpos = _mm512_min_epi32(
      _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first_pos)), lane),
      _mm512_set1_epi32(static_cast<int>(last_pos)));
  const __m512 vscale = _mm512_set1_ps(scale), vcap = _mm512_set1_ps(cap);
  const __m512 inv_cap = _mm512_set1_ps(cap > 0.f ? 1.f / cap : 0.f);
  const __m512i horizon = _mm512_sub_epi32(qpos, _mm512_set1_epi32(static_cast<int>(window)));
  const int64_t first_key = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  for (int64_t k0 = first_key / kRunLanes * kRunLanes; k0 <= last_pos; k0 += kRunLanes) {
    // The tile's rows, copied so that one register addresses them all; keys past the last
    // query (a partial tile) repeat its row and are masked out below.
    __mmask16 seen[kRunLanes];
    for (int64_t j = 0; j < kRunLanes; ++j) {
      const int64_t pos = std::min(k0 + j, last_pos);
      const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
      std::memcpy(s.kt.data() + j * DIM, keys + slot * row, DIM * sizeof(c10::BFloat16));
      for (int64_t d = 0; d < DIM; d += 16)
        _mm512_storeu_ps(s.vf.data() + j * DIM + d, load16(values + slot * row + d));
      const __m512i kpos = _mm512_set1_epi32(static_cast<int>(k0 + j));
      seen[j] = _mm512_cmpge_epi32_mask(qpos, kpos);
      if (window > 0) seen[j] &= _mm512_cmpgt_epi32_mask(kpos, horizon);
    }
    const int32_t* kt = reinterpret_cast<const int32_t*>(s.kt.data());
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc[kRunLanes];
      for (int j = 0; j < kRunLanes; ++j) acc[j] = _mm512_setzero_ps();
      const uint32_t* qg = s.qt.data() + g * kPairs * kRunLanes;
      for (int64_t p0 = 0; p0 < kPairs; p0 += 8) {
        __m512i qr[8];
        for (int u = 0; u < 8; ++u)
          qr[u] = _mm512_loadu_si512(qg + (p0 + u) * kRunLanes);
        for (int u = 0; u < 8; ++u)
          for (int j = 0; j < kRunLanes; ++j)
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)qr[u],
                                      (__m512bh)_mm512_set1_epi32(kt[j * kPairs + p0 + u]));
      }
      float* peak = s.peak.data() + g * kRunLanes;
      float* total = s.total.data() + g * kRunLanes;
      const __m512 old_peak = _mm512_loadu_ps(peak);
      __m512 top = old_peak;
      for (int j = 0; j < kRunLanes; ++j) {
        acc[j] = _mm512_mul_ps(acc[j], vscale);
        if (cap > 0.f) acc[j] = _mm512_mul_ps(tanh16(_mm512_mul_ps(acc[j], inv_cap)), vcap);
        top = _mm512_mask_max_ps(top, seen[j], top, acc[j]);
      }
      const __m512 rescale = exp16(_mm512_sub_ps(old_peak, top));
      __m512 sum = _mm512_setzero_ps();
      for (int j = 0; j < kRunLanes; ++j) {
        const __m512 w = _mm512_maskz_mov_ps(seen[j], exp16(_mm512_sub_ps(acc[j], top)));
        _mm512_store_ps(s.p[j], w);
        sum = _mm512_add_ps(sum, w);
      }
      _mm512_storeu_ps(peak, top);
      _mm512_storeu_ps(total, _mm512_fmadd_ps(_mm512_loadu_ps(total), rescale, sum));
      float* og = s.o.data() + g * DIM * kRunLanes;
      for (int64_t d0 = 0; d0 < DIM; d0 += 16) {
        __m512 o[16];
        for (int d = 0; d < 16; ++d)
          o[d] = _mm512_mul_ps(_mm512_loadu_ps(og + (d0 + d) * kRunLanes), rescale);
        for (int j = 0; j < kRunLanes; ++j) {
          const __m512 w = _mm512_load_ps(s.p[j]);
          const float* v = s.vf.data() + j * DIM + d0;
          for (int d = 0; d < 16; ++d) o[d] = _mm512_fmadd_ps(w, _mm512_set1_ps(v[d]), o[d]);
        }
        for (int d = 0; d < 16; ++d) _mm512_storeu_ps(og + (d0 + d) * kRunLanes, o[d]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float* og = s.o.data() + g * DIM * kRunLanes;
    const float* total = s.total.data() + g * kRunLanes;
    for (int64_t i = 0; i < nq; ++i) {
      c10::BFloat16* dst = out + i * os0 + g * os1;
      const float inv = 1.f / total[i];
      for (int64_t d = 0; d < DIM; ++d)
        dst[d] = static_cast<c10::BFloat16>(og[d * kRunLanes + i] * inv);
    }
  }
}
#endif

// Whether prompt runs take prefill_block: bf16 queries and cache, a head size it is built for.
template <typename q_t, typename cache_t>
bool runs_supported(int64_t dim) {
#if defined(__AVX512BF16__)
  return std::is_same_v<q_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16> &&
         (dim == 64 || dim == 128 || dim == 256);
#else
  return false;
#endif
}

// Splits the entries (one per query token) into runs of at least kMinRun tokens at consecutive
// positions that see the same blocks, and the single entries left. Entry e joins the run begun
// at `first` when its token follows e - 1's, its context is one longer, and its table matches
// the run's first entry's through the block of its own position: then the run's queries see
// exactly the keys they would each see alone (requests that share cached blocks included).
void split_runs(int64_t entries, const int64_t* tok, const int64_t* lens, const int64_t* tables,
                int64_t bt_stride, int64_t block_size, std::vector<QueryRun>& runs,
                std::vector<int64_t>& single) {
  auto flush = [&](int64_t first, int64_t n) {
    if (n >= kMinRun) {
      runs.push_back({first, n});
    } else {
      for (int64_t e = first; e < first + n; ++e) single.push_back(e);
    }
  };
  int64_t first = 0;
  for (int64_t e = 1; e <= entries; ++e) {
    const bool joins =
        e < entries && tok[e] == tok[e - 1] + 1 && lens[e] == lens[e - 1] + 1 &&
        std::memcmp(tables + e * bt_stride, tables + first * bt_stride,
                    ((lens[e] - 1) / block_size + 1) * sizeof(int64_t)) == 0;
    if (!joins) {
      flush(first, e - first);
      first = e;
    }
  }
}

#if defined(__AVX512BF16__)
// The runs' blocks of 16 queries times KV heads are the work items, longest context first, taken
// by whichever thread is free: a prompt's later blocks read more keys, and the per-query path,
// which hands each thread a contiguous half of the tokens, left one thread the longer half (a
// 440-token prompt: 2.3-2.9 ms a layer there, 1.5 here, on 2 threads; alike on one).
void prefill_runs(const std::vector<QueryRun>& runs, const c10::BFloat16* qp, int64_t qs0,
                  int64_t qs1, c10::BFloat16* op, int64_t os0, int64_t os1,
                  const c10::BFloat16* kp, const c10::BFloat16* vp, int64_t row, int64_t dim,
                  int64_t kv_heads, int64_t group, const int64_t* tok, const int64_t* lens,
                  const int64_t* tables, int64_t bt_stride, int64_t block_size, float scale,
                  float cap, int64_t window) {
  struct Item {
    int64_t entry, nq, kvh;
  };
  std::vector<Item> items;
  for (const QueryRun& run : runs)
    for (int64_t b = 0; b < run.count; b += kRunLanes)
      for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
        items.push_back({run.entry + b, std::min(kRunLanes, run.count - b), kvh});
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return lens[a.entry + a.nq - 1] > lens[b.entry + b.nq - 1];
  });
  std::atomic<int64_t> next{0};
  const int64_t total = static_cast<int64_t>(items.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    PrefillScratch s;
    for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
      const Item& it = items[i];
      const int64_t e = it.entry, h0 = it.kvh * group;
      const c10::BFloat16* keys = kp + it.kvh * dim;
      const c10::BFloat16* values = vp + it.kvh * dim;
      const int64_t* table = tables + e * bt_stride;
      const c10::BFloat16* q = qp + tok[e] * qs0 + h0 * qs1;
      c10::BFloat16* out = op + tok[e] * os0 + h0 * os1;
      const int64_t first_pos = lens[e] - 1;
      switch (dim) {
        case 64:
          prefill_block<64>(keys, values, row, table, block_size, q, qs0, qs1, it.nq, first_pos,
                            group, scale, cap, window, out, os0, os1, s);
          break;
        case 128:
          prefill_block<128>(keys, values, row, table, block_size, q, qs0, qs1, it.nq,
                             first_pos, group, scale, cap, window, out, os0, os1, s);
          break;
        default:
          prefill_block<256>(keys, values, row, table, block_size, q, qs0, qs1, it.nq,
                             first_pos, group, scale, cap, window, out, os0, os1, s);
          break;
      }
    }
  });
}
#endif

// One query token per request over its paged context. A work item is a request, or with fewer
// requests than threads a range of its keys (flash-decoding: one long request keeps every thread
// busy, and the ranges' unnormalized sums are merged by their peak scores afterwards). Each item
// takes all heads; the query heads sharing a KV head read the same keys, from L1 after the
// first. Scores are exact (logits, then a max-subtracted softmax), matching the reference up to
// float rounding. With `lse`, each query's log-sum-exp of its scores per head goes there too
// ([tokens, heads]: context parallelism combines partial attentions by it), and prompts are taken
// a token at a time.
template <typename q_t, typename cache_t>
void decode_attention_typed(at::Tensor& out, const at::Tensor& q, const at::Tensor& kc,
                            const at::Tensor& vc, const at::Tensor& token_index,
                            const at::Tensor& block_table, const at::Tensor& seq_lens,
                            double scale, double softcap, int64_t window,
                            float* lse = nullptr) {
  const int64_t num_req = token_index.size(0);
  const int64_t heads = q.size(1), dim = q.size(2);
  const int64_t block_size = kc.size(1), kv_heads = kc.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * dim;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const int64_t bt_stride = block_table.stride(0);
  const q_t* qp = q.data_ptr<q_t>();
  q_t* op = out.data_ptr<q_t>();
  const cache_t* kp = kc.data_ptr<cache_t>();
  const cache_t* vp = vc.data_ptr<cache_t>();
  const int64_t* tok = token_index.data_ptr<int64_t>();
  const int64_t* tables = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  // Prompt tokens go in runs to prefill_block; the rest (`single`, indices of entries) below.
  std::vector<QueryRun> runs;
  std::vector<int64_t> single;
  if (lse == nullptr && runs_supported<q_t, cache_t>(dim)) {
    split_runs(num_req, tok, lens, tables, bt_stride, block_size, runs, single);
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<q_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>)
      if (!runs.empty())
        prefill_runs(runs, qp, qs0, qs1, op, os0, os1, kp, vp, row, dim, kv_heads, group, tok,
                     lens, tables, bt_stride, block_size, fscale, fcap, window);
#endif
  } else {
    single.resize(num_req);
    std::iota(single.begin(), single.end(), int64_t{0});
  }
  const int64_t num_single = static_cast<int64_t>(single.size());
  if (num_single == 0) return;
  const int64_t threads = at::get_num_threads();
  // Key ranges per request: enough items to be a multiple of the thread count.
  const int64_t ranges = num_single >= threads ? 1 : threads / std::gcd(num_single, threads);
  const int64_t items = num_single * ranges;
  const int64_t width = heads * dim;
  // Partial results of split requests: unnormalized sums, peaks and exp totals per head.
  std::vector<float> part_acc(ranges > 1 ? items * width : 0);
  std::vector<float> part_peak(ranges > 1 ? items * heads : 0), part_total(part_peak.size());

  // Item i's keys: a range [lo, lo + n) of entry single[i / ranges]'s context.
  auto key_range = [&](int64_t item) {
    const int64_t r = single[item / ranges], c = item % ranges, len = lens[r];
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t lo = first + (len - first) * c / ranges;
    return std::make_pair(lo, first + (len - first) * (c + 1) / ranges - lo);
  };
  // Its slots, walked block by block (an integer division per key costs more than the key's
  // dot products).
  auto item_slots = [&](int64_t item, std::vector<int64_t>& out) {
    const auto [lo, n] = key_range(item);
    const int64_t* table = tables + single[item / ranges] * bt_stride;
    out.resize(n);
    for (int64_t j = 0, pos = lo; j < n;) {
      const int64_t base = table[pos / block_size] * block_size;
      for (int64_t off = pos % block_size; off < block_size && j < n; ++off, ++j, ++pos)
        out[j] = base + off;
    }
  };

  // Items go longest first to whichever thread is free: a static split gave one thread the
  // longer contexts. A thread claims its next item before computing the current one, so that
  // item's rows can stream in meanwhile.
  std::vector<int64_t> order(items);
  std::iota(order.begin(), order.end(), int64_t{0});
  if (ranges == 1)
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return lens[single[a]] > lens[single[b]];
    });
  std::atomic<int64_t> claimed{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> qf(width), acc(width), peak(heads), total(heads), row_f(dim), scores;
    std::vector<int64_t> slots, next_slots;
    KvPrefetch pf{reinterpret_cast<const char*>(kp), reinterpret_cast<const char*>(vp),
                  static_cast<int64_t>(row * sizeof(cache_t))};
    int64_t at = claimed.fetch_add(1);
    if (at >= items) return;
    item_slots(order[at], next_slots);
    if (static_cast<int64_t>(next_slots.size()) * pf.row_bytes * 2 <= kBurstBytes)  // see there
      for (const int64_t slot : next_slots) pf.fetch_row(slot);
    for (bool first = true; at < items; first = false) {
      const int64_t item = order[at];
      const int64_t r = single[item / ranges];
      at = claimed.fetch_add(1);
      slots.swap(next_slots);
      next_slots.clear();
      const int64_t n = static_cast<int64_t>(slots.size());
      // The next item's rows stream in while this one computes, unless it reads this item's
      // keys again (a prompt's next token: same first and last slot of this range; requests
      // that share only a cached prefix block differ in the last).
      if (at < items) {
        item_slots(order[at], next_slots);
        const bool same = !slots.empty() && next_slots.size() >= slots.size() &&
                          slots[0] == next_slots[0] && slots.back() == next_slots[slots.size() - 1];
        pf.start(next_slots.data(), same ? 0 : static_cast<int64_t>(next_slots.size()));
      } else {
        pf.start(nullptr, 0);
      }
      KvPrefetch* stream = pf.next_n > 0 ? &pf : nullptr;
      if (n > 0) {
        scores.resize(heads * n);
        // Every head of the item at once where a path does (bf16 on AVX-512-BF16, float32
        // queries on AVX2), else float32 head by head, else the generic loops.
        bool fast = attend_kv_heads(kp, vp, slots.data(), n, row, dim, kv_heads,
                                    qp + tok[r] * qs0, qs1, group, fscale, fcap, scores.data(),
                                    acc.data(), peak.data(), total.data(),
                                    first || stream != nullptr ? &pf : nullptr, first);
        if (!fast) {  // the float32 paths take q widened
          for (int64_t h = 0; h < heads; ++h) {
            const q_t* src = qp + tok[r] * qs0 + h * qs1;
            for (int64_t d = 0; d < dim; ++d) qf[h * dim + d] = to_f(src[d]);
          }
          fast = true;
          for (int64_t h = 0; h < heads && fast; ++h) {
            const int64_t kvh = h / group;
            fast = attend_head(kp + kvh * dim, vp + kvh * dim, slots.data(), n, row, dim,
                               qf.data() + h * dim, fscale, fcap, scores.data() + h * n,
                               acc.data() + h * dim, &peak[h], &total[h]);
          }
        }
        if (!fast) {
          for (int64_t j = 0; j < n; ++j) {
            const cache_t* keys = kp + slots[j] * row;
            for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
              const int64_t q0 = kvh * group;
              float dots[kMaxGroup];
              dot_queries(keys + kvh * dim, qf.data() + q0 * dim, group, dim, row_f.data(), dots);
              for (int64_t g = 0; g < group; ++g) {
                float s = dots[g] * fscale;
                if (fcap > 0.f) s = std::tanh(s / fcap) * fcap;
                scores[(q0 + g) * n + j] = s;
              }
            }
          }
          for (int64_t h = 0; h < heads; ++h) {
            float* sh = scores.data() + h * n;
            peak[h] = peak_of(sh, n);
            total[h] = exp_shifted(sh, n, peak[h]);
          }
          std::fill(acc.begin(), acc.end(), 0.f);
          for (int64_t j = 0; j < n; ++j) {
            const cache_t* values = vp + slots[j] * row;
            for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
              const int64_t q0 = kvh * group;
              float probs[kMaxGroup];
              for (int64_t g = 0; g < group; ++g) probs[g] = scores[(q0 + g) * n + j];
              add_scaled(values + kvh * dim, probs, group, dim, row_f.data(),
                         acc.data() + q0 * dim);
            }
          }
        }
      } else {  // an empty range (a context shorter than the ranges): weighs nothing
        std::fill(acc.begin(), acc.end(), 0.f);
        std::fill(peak.begin(), peak.end(), -std::numeric_limits<float>::infinity());
        std::fill(total.begin(), total.end(), 0.f);
      }
      if (ranges > 1) {
        std::copy(acc.begin(), acc.end(), part_acc.begin() + item * width);
        std::copy(peak.begin(), peak.end(), part_peak.begin() + item * heads);
        std::copy(total.begin(), total.end(), part_total.begin() + item * heads);
        continue;
      }
      for (int64_t h = 0; h < heads; ++h) {
        q_t* dst = op + tok[r] * os0 + h * os1;
        const float inv = 1.f / total[h];
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<q_t>(acc[h * dim + d] * inv);
        if (lse != nullptr) lse[tok[r] * heads + h] = peak[h] + std::log(total[h]);
      }
    }
  });
  if (ranges == 1) return;
  std::vector<float> weights(ranges);
  for (int64_t i = 0; i < num_single; ++i) {  // fewer requests than threads: a few heads to merge
    const int64_t r = single[i], item0 = i * ranges;
    for (int64_t h = 0; h < heads; ++h) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < ranges; ++c) top = std::max(top, part_peak[(item0 + c) * heads + h]);
      float denom = 0.f;
      for (int64_t c = 0; c < ranges; ++c) {
        const int64_t at = (item0 + c) * heads + h;
        weights[c] = part_total[at] > 0.f ? std::exp(part_peak[at] - top) : 0.f;
        denom += weights[c] * part_total[at];
      }
      q_t* dst = op + tok[r] * os0 + h * os1;
      for (int64_t d = 0; d < dim; ++d) {
        float sum = 0.f;
        for (int64_t c = 0; c < ranges; ++c)
          sum += weights[c] * part_acc[(item0 + c) * width + h * dim + d];
        dst[d] = static_cast<q_t>(sum / denom);
      }
      if (lse != nullptr) lse[tok[r] * heads + h] = top + std::log(denom);
    }
  }
}

}  // namespace
