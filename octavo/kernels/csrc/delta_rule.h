// The gated delta rule's single-token step (linear attention, octavo/model/layers/
// gated_delta_net.py): for each request r and value head h, with its state S [d_k, d_v] at
// state[rows[r], h],
//
//     S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
//
// in place, in two passes over S (decay with S^T k, then the update with S^T q) where the
// PyTorch form reads and writes a copy of every state several times. float32 throughout.
// Included by cpu_ops.cpp only (ops.h declares the step for DecodeStack).
#pragma once

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

// state: float32 [N, H, d_k, d_v]; rows: int64 [R], distinct (one per request); q, k: float32 [R, H, d_k]; v: [R, H, d_v];
// beta, g: float32 [R, H] -> o float32 [R, H, d_v].
at::Tensor delta_rule_step(at::Tensor state, const at::Tensor& rows, const at::Tensor& q,
                           const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
                           const at::Tensor& g) {
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.dim() == 4 && state.is_contiguous(),
              "delta_rule_step: state must be contiguous float32 [N, H, d_k, d_v]");
  const int64_t heads = state.size(1), dk = state.size(2), dv = state.size(3);
  const int64_t r_count = rows.numel();
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "delta_rule_step: rows must be contiguous int64");
  for (const auto* t : {&q, &k, &v, &beta, &g})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->size(0) == r_count && t->size(1) == heads,
                "delta_rule_step: q, k, v, beta and g must be contiguous float32 [R, H, ...]");
  TORCH_CHECK(q.size(2) == dk && k.size(2) == dk && v.size(2) == dv && beta.dim() == 2 &&
                  g.dim() == 2,
              "delta_rule_step: q, k [R, H, d_k], v [R, H, d_v], beta and g [R, H]");
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < r_count; ++r)
    TORCH_CHECK(row[r] >= 0 && row[r] < state.size(0), "delta_rule_step: row out of range");
  auto out = at::empty({r_count, heads, dv}, q.options());
  float* sp = state.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>(),
              *bp = beta.data_ptr<float>(), *gp = g.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, r_count * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> delta(dv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / heads, h = task % heads;
      float* s = sp + (row[r] * heads + h) * dk * dv;
      const float* kr = kp + task * dk;
      const float* qr = qp + task * dk;
      const float* vr = vp + task * dv;
      float* o = op + task * dv;
      const float decay = std::exp(gp[task]), b = bp[task];
      for (int64_t j = 0; j < dv; ++j) delta[j] = 0.0f;  // S^T k, then the update
      for (int64_t i = 0; i < dk; ++i) {
        float* si = s + i * dv;
        const float ki = kr[i];
        for (int64_t j = 0; j < dv; ++j) {
          si[j] *= decay;
          delta[j] += ki * si[j];
        }
      }
      for (int64_t j = 0; j < dv; ++j) {
        delta[j] = (vr[j] - delta[j]) * b;
        o[j] = 0.0f;
      }
      for (int64_t i = 0; i < dk; ++i) {
        float* si = s + i * dv;
        const float ki = kr[i], qi = qr[i];
        for (int64_t j = 0; j < dv; ++j) {
          si[j] += ki * delta[j];
          o[j] += qi * si[j];
        }
      }
    }
  });
  return out;
}
