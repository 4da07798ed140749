// Qwen3-Next's Gated DeltaNet (linear attention over a recurrent state per request) as a layer of
// DecodeStack (decode_stack.h), for steps where every request brings one token: the ops of
// octavo/model/layers/gated_delta_net.py (GatedDeltaNet.forward's single-token path) in its
// order, up to out_proj's input. The states live in the Python layer's buffers, at each
// request's batch row; the stack moves them in place as the layer does. Included by cpu_ops.cpp
// only, after stack_linear.h.
#pragma once

#include <cmath>

// The linear attention's weights, sizes and states (octavo/model/layer_spec.py, DeltaNetSpec).
struct StackDeltaNet {
  StackLinear qkvz, ba;  // in_proj_qkvz (q | k | v and z, or grouped per key head), in_proj_ba
  bool qkvz_split = false;  // q | k | v of all heads then z (llama.cpp), else grouped (HF)
  at::Tensor conv_weight;   // [conv_dim, K]: the depthwise convolution's taps
  at::Tensor decay_rate;    // float32 [v_heads]: -exp(A_log)
  at::Tensor dt_bias;       // [v_heads]
  at::Tensor norm_weight;   // [d_v]: GatedRMSNorm's
  double norm_eps = 1e-6;
  int64_t k_heads = 0, v_heads = 0, dk = 0, dv = 0;
  at::Tensor conv_state;  // [rows, conv_dim, K - 1] in the activations' dtype
  at::Tensor ssm_state;   // float32 [rows, v_heads, d_k, d_v]
};

// F.normalize's ops over the last dimension.
inline at::Tensor l2_normalized(const at::Tensor& y, double eps) {
  return y / at::linalg_vector_norm(y, 2, at::IntArrayRef{-1}, true).clamp_min(eps);
}

// xn [T, hidden] (the layer's normed input; token i is the request at state row rows[i]) ->
// [T, v_heads * d_v], out_proj's input. Moves each row's conv window and state by its token.
inline at::Tensor delta_net_step(const StackDeltaNet& d, const at::Tensor& xn,
                                 const at::Tensor& rows, const LoraStep& lora) {
  RECORD_FUNCTION("octavo::delta_net_step", std::vector<c10::IValue>());
  const int64_t t = xn.size(0), per = d.v_heads / d.k_heads, key = d.k_heads * d.dk,
                value = d.v_heads * d.dv, conv_dim = 2 * key + value;
  // GatedDeltaNet._project
  auto mixed = d.qkvz(xn, lora);
  at::Tensor qkv, z;
  if (d.qkvz_split) {
    qkv = mixed.narrow(1, 0, conv_dim);
    z = mixed.narrow(1, conv_dim, value);
  } else {
    auto parts = mixed.view({t, d.k_heads, -1}).split_with_sizes({d.dk, d.dk, per * d.dv,
                                                                   per * d.dv}, -1);
    qkv = at::cat({parts[0].reshape({t, -1}), parts[1].reshape({t, -1}),
                   parts[2].reshape({t, -1})}, -1);
    z = parts[3];
  }
  z = z.reshape({t, d.v_heads, d.dv});
  auto ba = d.ba(xn, lora).view({t, d.k_heads, 2 * per});
  auto beta = ba.narrow(2, 0, per).reshape({t, d.v_heads}).sigmoid().to(at::kFloat);
  auto g = d.decay_rate *
           at::softplus(ba.narrow(2, per, per).reshape({t, d.v_heads}).to(at::kFloat) +
                        d.dt_bias);
  // _conv_step: the window moves on by the token
  auto window = at::cat({d.conv_state.index_select(0, rows), qkv.unsqueeze(-1)}, -1);
  d.conv_state.index_put_({rows}, window.narrow(-1, 1, window.size(-1) - 1));
  auto conv = at::silu((window * d.conv_weight).sum(-1)).to(at::kFloat);
  // _heads
  auto q = l2_normalized(conv.narrow(1, 0, key).view({t, d.k_heads, d.dk}), 1e-6)
               .repeat_interleave(per, 1);
  auto k = l2_normalized(conv.narrow(1, key, key).view({t, d.k_heads, d.dk}), 1e-6)
               .repeat_interleave(per, 1);
  q = q * std::pow(static_cast<double>(d.dk), -0.5);
  auto v = conv.narrow(1, 2 * key, value).view({t, d.v_heads, d.dv});
  // _recurrent_step (fused.delta_rule_step)
  auto out = delta_rule_step(d.ssm_state, rows, q.contiguous(), k.contiguous(), v.contiguous(),
                             beta.contiguous(), g.contiguous());
  // GatedRMSNorm of each head's output, times silu(z)
  const auto dtype = xn.scalar_type();
  auto h = out.to(dtype).reshape({-1, d.dv}).to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, true) + d.norm_eps);
  h = d.norm_weight * h.to(dtype);
  return (h * at::silu(z.reshape({-1, d.dv}).to(at::kFloat))).to(dtype).reshape({t, value});
}
