// Qwen3-Next's Gated DeltaNet (linear attention over a recurrent state per request) as a layer of
// DecodeStack (decode_stack.h), for steps without draft tokens: the ops of octavo/model/layers/
// gated_delta_net.py (GatedDeltaNet.forward: single tokens batched, prompt chunks and verified
// spans one request at a time in the chunked form) in its order, up to out_proj's input. The
// states, saved states and span buffers live in the Python layer's buffers, at each request's
// batch row; the stack moves and fills them in place as the layer does.
// Included by decode_stack.cpp only, after stack_linear.h.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <utility>

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
  int64_t chunk = 64;     // tokens a triangular solve takes at once (gated_delta_net.CHUNK)
  at::Tensor conv_state;  // [rows, conv_dim, K - 1] in the activations' dtype
  at::Tensor ssm_state;   // float32 [rows, v_heads, d_k, d_v]
  // a verified span's inputs until its verdict (undefined without speculative decoding): the
  // window then the inputs [rows, conv_dim, K - 1 + span], the convolved inputs [rows, span,
  // conv_dim], beta and g float32 [rows, span, v_heads]
  at::Tensor span_seq, span_conv, span_beta, span_g;
};

// F.normalize's ops over the last dimension.
inline at::Tensor l2_normalized(const at::Tensor& y, double eps) {
  return y / at::linalg_vector_norm(y, 2, at::IntArrayRef{-1}, true).clamp_min(eps);
}

// GatedDeltaNet._heads: the convolution's output [T, conv_dim] -> q, k [T, v_heads, d_k]
// (L2-normalized, q scaled; key heads repeated over their value heads), v [T, v_heads, d_v].
inline std::array<at::Tensor, 3> delta_net_heads(const StackDeltaNet& d, const at::Tensor& conv) {
  const int64_t t = conv.size(0), per = d.v_heads / d.k_heads, key = d.k_heads * d.dk;
  auto cf = conv.to(at::kFloat);
  auto q = l2_normalized(cf.narrow(1, 0, key).view({t, d.k_heads, d.dk}), 1e-6)
               .repeat_interleave(per, 1);
  auto k = l2_normalized(cf.narrow(1, key, key).view({t, d.k_heads, d.dk}), 1e-6)
               .repeat_interleave(per, 1);
  return {q * std::pow(static_cast<double>(d.dk), -0.5), k,
          cf.narrow(1, 2 * key, d.v_heads * d.dv).view({t, d.v_heads, d.dv})};
}

// GatedDeltaNet._chunked: a request's prompt tokens from its state s [H, d_k, d_v] -> their
// outputs [L, H, d_v] and the state after them, `chunk` tokens at a time.
inline std::pair<at::Tensor, at::Tensor> delta_net_chunked(const StackDeltaNet& d,
                                                           const at::Tensor& conv,
                                                           at::Tensor beta, at::Tensor g,
                                                           at::Tensor s) {
  auto heads = delta_net_heads(d, conv);
  auto q = heads[0].transpose(0, 1), k = heads[1].transpose(0, 1), v = heads[2].transpose(0, 1);
  beta = beta.t();
  g = g.t();
  auto out = at::empty_like(v);
  const int64_t length = q.size(1);
  for (int64_t c = 0; c < length; c += d.chunk) {
    const int64_t n = std::min(d.chunk, length - c);
    auto qc = q.narrow(1, c, n), kc = k.narrow(1, c, n), vc = v.narrow(1, c, n);
    auto bc = beta.narrow(1, c, n), cum = g.narrow(1, c, n).cumsum(-1);
    auto ratio = cum.unsqueeze(-1) - cum.unsqueeze(-2);
    auto below = at::ones({n, n}, q.options().dtype(at::kBool)).tril();
    auto decay = at::where(below, ratio, -std::numeric_limits<double>::infinity()).exp();
    auto m = kc.matmul(kc.transpose(-1, -2)) * decay * bc.unsqueeze(-1);
    m = m.tril(-1) + at::eye(n, q.options());
    auto rhs = bc.unsqueeze(-1) * (vc - cum.exp().unsqueeze(-1) * kc.matmul(s));
    auto dd = at::linalg_solve_triangular(m, rhs, /*upper=*/false, /*left=*/true,
                                          /*unitriangular=*/true);
    out.narrow(1, c, n).copy_(cum.exp().unsqueeze(-1) * qc.matmul(s) +
                              (qc.matmul(kc.transpose(-1, -2)) * decay).matmul(dd));
    auto last = cum.narrow(1, n - 1, 1);
    s = last.exp().unsqueeze(-1) * s +
        (kc * (last - cum).exp().unsqueeze(-1)).transpose(-1, -2).matmul(dd);
  }
  return {out.transpose(0, 1), s};
}

// A step's requests as the linear layers read them, laid out once a step: request r's len[r]
// tokens from start[r] (one request after another), its state at row[r], and where its states
// are saved (after that many of its tokens, into that row; prefix caching); the one-token
// requests' tokens and rows gathered for one batched update.
struct DeltaNetRequests {
  std::vector<int64_t> start, len, row;
  std::vector<bool> holds_span;  // its tokens end in drafts: its state waits for the verdict
  std::vector<std::vector<std::pair<int64_t, int64_t>>> saves;
  at::Tensor single_tokens, single_rows;  // int64
  bool all_single = true;
};

// state_rows, query_lens: int64 [R]; tokens: the step's (query_lens' sum); state_saves: int64
// [n, 3] (request, tokens into its step, state row), in each request's token order.
inline DeltaNetRequests delta_net_requests(const at::Tensor& state_rows,
                                           const at::Tensor& query_lens, int64_t tokens,
                                           const std::optional<at::Tensor>& state_saves,
                                           const std::optional<at::Tensor>& num_drafts) {
  TORCH_CHECK(state_rows.scalar_type() == at::kLong && query_lens.scalar_type() == at::kLong &&
                  state_rows.is_contiguous() && query_lens.is_contiguous() &&
                  state_rows.numel() == query_lens.numel(),
              "a linear attention layer needs each request's state row and token count "
              "(int64 [R], the counts adding up to the step's tokens)");
  DeltaNetRequests q;
  const int64_t* len = query_lens.data_ptr<int64_t>();
  const int64_t* row = state_rows.data_ptr<int64_t>();
  std::vector<int64_t> singles, single_rows;
  int64_t start = 0;
  for (int64_t r = 0; r < state_rows.numel(); start += len[r], ++r) {
    q.start.push_back(start);
    q.len.push_back(len[r]);
    q.row.push_back(row[r]);
    if (len[r] == 1) {
      singles.push_back(start);
      single_rows.push_back(row[r]);
    } else {
      q.all_single = false;
    }
  }
  TORCH_CHECK(start == tokens, "a linear attention layer needs each request's state row and "
              "token count (int64 [R], the counts adding up to the step's tokens)");
  q.single_tokens = at::tensor(singles, state_rows.options());
  q.single_rows = at::tensor(single_rows, state_rows.options());
  q.saves.resize(q.len.size());
  q.holds_span.assign(q.len.size(), false);
  if (num_drafts) {
    TORCH_CHECK(num_drafts->scalar_type() == at::kLong && num_drafts->is_contiguous() &&
                    num_drafts->numel() == static_cast<int64_t>(q.len.size()),
                "num_drafts: int64 [R], each request's draft tokens");
    const int64_t* drafts = num_drafts->data_ptr<int64_t>();
    for (size_t r = 0; r < q.len.size(); ++r) {
      TORCH_CHECK(drafts[r] == 0 || (drafts[r] < q.len[r]), "a span's drafts follow a token");
      q.holds_span[r] = drafts[r] > 0;
    }
  }
  if (state_saves && state_saves->numel()) {
    TORCH_CHECK(state_saves->scalar_type() == at::kLong && state_saves->is_contiguous() &&
                    state_saves->dim() == 2 && state_saves->size(1) == 3,
                "state_saves: int64 [n, 3] (request, tokens into its step, state row)");
    const int64_t* s = state_saves->data_ptr<int64_t>();
    for (int64_t i = 0; i < state_saves->size(0); ++i, s += 3) {
      TORCH_CHECK(s[0] >= 0 && s[0] < static_cast<int64_t>(q.len.size()) && s[1] >= 1 &&
                      s[1] <= q.len[s[0]] && !q.holds_span[s[0]] &&
                      (q.saves[s[0]].empty() || q.saves[s[0]].back().first <= s[1]),
                  "state_saves: a save past its request's tokens, in a span ending in drafts, "
                  "or out of order");
      q.saves[s[0]].emplace_back(s[1], s[2]);
    }
  }
  return q;
}

// xn [T, hidden] (the layer's normed input, laid out as `q`) -> [T, v_heads * d_v], out_proj's
// input. Moves each request's conv window and state over its tokens.
inline at::Tensor delta_net_step(const StackDeltaNet& d, const at::Tensor& xn,
                                 const DeltaNetRequests& q, const LoraStep& lora) {
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
  auto out = at::empty({t, d.v_heads, d.dv}, xn.options().dtype(at::kFloat));
  if (q.single_tokens.numel()) {  // decodes: one batched step of every such request's state
    const auto& tokens = q.single_tokens;
    const auto& state_rows = q.single_rows;
    // _conv_step: the window moves on by the token
    auto window = at::cat({d.conv_state.index_select(0, state_rows),
                           qkv.index_select(0, tokens).unsqueeze(-1)}, -1);
    d.conv_state.index_put_({state_rows}, window.narrow(-1, 1, window.size(-1) - 1));
    auto heads = delta_net_heads(d, at::silu((window * d.conv_weight).sum(-1)));
    // _recurrent_step (fused.delta_rule_step)
    auto o = delta_rule_step(d.ssm_state, state_rows, heads[0].contiguous(),
                             heads[1].contiguous(), heads[2].contiguous(),
                             beta.index_select(0, tokens), g.index_select(0, tokens));
    if (q.all_single)
      out = o;
    else
      out.index_copy_(0, tokens, o);
    for (size_t r = 0; r < q.len.size(); ++r) {  // a boundary reached by a single token
      if (q.len[r] != 1) continue;
      for (const auto& [count, save_row] : q.saves[r]) {
        d.conv_state[save_row].copy_(d.conv_state[q.row[r]]);
        d.ssm_state[save_row].copy_(d.ssm_state[q.row[r]]);
      }
    }
  }
  const int64_t window_len = d.conv_weight.size(1) - 1;
  for (size_t r = 0; r < q.len.size(); ++r) {  // prompt chunks, one request at a time
    if (q.len[r] == 1) continue;
    const int64_t row = q.row[r], start = q.start[r], len = q.len[r];
    // _conv_chunk: the window, then the tokens, convolved
    auto seq = at::cat({d.conv_state[row], qkv.narrow(0, start, len).t()}, -1);
    const std::optional<at::Tensor> no_bias;
    auto conv = at::silu(at::conv1d(seq.unsqueeze(0), d.conv_weight.unsqueeze(1), no_bias,
                                    at::IntArrayRef{1}, at::IntArrayRef{0}, at::IntArrayRef{1},
                                    conv_dim)[0]).t();
    if (q.holds_span[r]) {  // computed from the state before it, which waits for the verdict
      TORCH_CHECK(d.span_seq.defined() && len <= d.span_conv.size(1),
                  "a verified span longer than the span buffers (set_delta_net_spans)");
      auto [o, s] = delta_net_chunked(d, conv, beta.narrow(0, start, len),
                                      g.narrow(0, start, len), d.ssm_state[row]);
      out.narrow(0, start, len).copy_(o);
      d.span_seq[row].narrow(-1, 0, seq.size(-1)).copy_(seq);
      d.span_conv[row].narrow(0, 0, len).copy_(conv);
      d.span_beta[row].narrow(0, 0, len).copy_(beta.narrow(0, start, len));
      d.span_g[row].narrow(0, 0, len).copy_(g.narrow(0, start, len));
      continue;
    }
    // GatedDeltaNet._chunked_saving: in pieces that end where the states are saved
    at::Tensor state = d.ssm_state[row];
    int64_t begin = 0;
    auto pieces = q.saves[r];
    pieces.emplace_back(len, -1);
    for (const auto& [end, save_row] : pieces) {
      if (end > begin) {
        auto [o, s] = delta_net_chunked(d, conv.narrow(0, begin, end - begin),
                                        beta.narrow(0, start + begin, end - begin),
                                        g.narrow(0, start + begin, end - begin), state);
        out.narrow(0, start + begin, end - begin).copy_(o);
        state = s;
      }
      if (save_row >= 0) {
        d.conv_state[save_row].copy_(seq.narrow(-1, end, window_len));
        d.ssm_state[save_row].copy_(state);
      }
      begin = end;
    }
    d.conv_state[row].copy_(seq.narrow(-1, seq.size(-1) - window_len, window_len));
    d.ssm_state[row].copy_(state);
  }
  // GatedRMSNorm of each head's output, times silu(z)
  const auto dtype = xn.scalar_type();
  auto h = out.to(dtype).reshape({-1, d.dv}).to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, true) + d.norm_eps);
  h = d.norm_weight * h.to(dtype);
  return (h * at::silu(z.reshape({-1, d.dv}).to(at::kFloat))).to(dtype).reshape({t, value});
}
