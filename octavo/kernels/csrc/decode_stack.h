// DecodeStack: the decoder layers of a model for a step whose attention the in-place kernel takes
// whole (decodes, short queries, prompts: one attention entry per query token), as one call: the
// same kernels the Python layers call, without a Python frame and a dozen dispatches per layer
// around each of them (about 3 ms a step for a 30-layer model, a third of a batch-1 decode step).
// octavo/model/decode_stack.py builds it from each layer's description (octavo/model/
// layer_spec.py) and checks what it supports: RMSNorm, Gemma's 1 + w and LayerNorm, placed before
// each sublayer, after it or both, sequential or parallel residuals (scaled or not), q/k norms
// per head or over all heads (RMS, or LayerNorms per head), RoPE over all or part of a head or none, dense gated or plain MLPs
// and mixtures of experts.
// Included by decode_stack.cpp after StackLinear; the kernels it calls are ops.h's.
#pragma once

#include <ATen/record_function.h>

#include <numeric>

#include "stack_layer.h"

// One attention plan of a step as the kernel reads it (paged_attention.DecodeGroup): the
// entries' tokens, their requests' block tables and context lengths, and the plan's window
// (0: none).
using StackPlan = std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t>;

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps) {}

  // A layer is given in four calls, in this order: its attention (add_layer), its norms, its
  // linear layers and its MLP.
  // kv_cache: None for a layer whose linear attention keeps a state instead (set_delta_net).
  // k_scale, v_scale: an fp8 cache's (PagedAttention's), ignored for a cache in the
  // activations' dtype.
  // sinks: float32 [heads], a logit per head that joins each softmax's denominator (gpt-oss).
  void add_layer(std::optional<at::Tensor> kv_cache, std::optional<at::Tensor> cos,
                 std::optional<at::Tensor> sin, double scale, double softcap,
                 const std::string& plan, double k_scale, double v_scale,
                 std::optional<at::Tensor> sinks) {
    TORCH_CHECK(layers_.empty() || layers_.back().complete, "the last layer is not complete");
    TORCH_CHECK(cos.has_value() == sin.has_value(), "rotary tables come in pairs");
    StackLayer l;
    if (!kv_cache) {
      TORCH_CHECK(!cos && !sinks, "a layer without a KV cache has no rotary tables or sinks");
      l.plan = plan_index(plan);
      layers_.push_back(std::move(l));
      return;
    }
    TORCH_CHECK(kv_cache->dim() == 5 && kv_cache->size(0) == 2, "kv cache must be [2, ...]");
    if (cos) {
      TORCH_CHECK(cos->scalar_type() == at::kFloat && cos->is_contiguous() &&
                  sin->is_contiguous() && cos->size(1) * 2 <= head_dim_,
                  "rotary tables must be float32 [P, rotary_dim / 2], rotary_dim <= head_dim");
      l.cos = *cos;
      l.sin = *sin;
    }
    l.k_cache = (*kv_cache)[0];
    l.v_cache = (*kv_cache)[1];
    check_cache(l.k_cache, l.v_cache);
    l.fp8_cache = kv_cache->scalar_type() == at::kFloat8_e4m3fn;
    TORCH_CHECK(!l.fp8_cache || (k_scale > 0 && v_scale > 0), "fp8 cache scales must be > 0");
    l.k_scale = l.fp8_cache ? k_scale : 1.0;
    l.v_scale = l.fp8_cache ? v_scale : 1.0;
    l.scale = scale;
    l.softcap = softcap;
    l.plan = plan_index(plan);
    if (sinks) {
      TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->numel() == heads_,
                  "sinks must be float32 [heads]");
      l.sinks = sinks->contiguous();
    }
    layers_.push_back(std::move(l));
  }

  // weights: [attn_in, attn_out, mlp_in, mlp_out, q_norm, k_norm], None where absent; biases:
  // LayerNorm's, for the first four (None: a LayerNorm without one). qk_norm: how q_norm and
  // k_norm apply (stack_qk_norm); residual_scale: each sublayer's output is scaled by it.
  void set_norms(const std::string& kind, std::vector<std::optional<at::Tensor>> weights,
                 std::vector<std::optional<at::Tensor>> biases, bool parallel_residual,
                 const std::string& qk_norm, double residual_scale) {
    StackLayer& l = building();
    TORCH_CHECK(weights.size() == 6 && biases.size() == 4, "norms: six weights, four biases");
    l.norm_kind = stack_norm_kind(kind);
    const bool layer_norm = l.norm_kind == StackNormKind::kLayer;
    for (int i = 0; i < 4; ++i) {
      l.norm_w[i] = weights[i] ? *weights[i] : at::Tensor();  // a call after a refused one
      l.norm_b[i] = biases[i] ? *biases[i] : at::Tensor();    // starts over
      TORCH_CHECK((layer_norm && weights[i]) || !biases[i],
                  "a bias comes with a LayerNorm's weight, other norms have none");
    }
    l.qk_norm = stack_qk_norm(qk_norm);
    l.residual_scale = residual_scale;
    l.q_norm = weights[4] ? *weights[4] : at::Tensor();
    l.k_norm = weights[5] ? *weights[5] : at::Tensor();
    TORCH_CHECK(!l.q_norm.defined() || layer_norm == (l.qk_norm == StackQkNorm::kHeadLayer),
                "q/k norms beside LayerNorms are per-head LayerNorms, else RMS norms");
    const bool all_heads = l.qk_norm != StackQkNorm::kHead;
    TORCH_CHECK(!l.q_norm.defined() ||
                (l.q_norm.numel() == (all_heads ? heads_ : 1) * head_dim_ &&
                 l.k_norm.numel() == (all_heads ? kv_heads_ : 1) * head_dim_),
                "q/k norm weights span a head, or all of a token's heads where whole or per "
                "head");
    for (const auto& n : {l.norm_w[0], l.norm_w[1], l.norm_w[2], l.norm_w[3], l.q_norm, l.k_norm})
      TORCH_CHECK(!n.defined() || (n.is_contiguous() && (l.norm_kind != StackNormKind::kOnePlus ||
                                                         n.scalar_type() == at::kFloat)),
                  "norm weights must be contiguous (1 + w: float32)");
    l.parallel_residual = parallel_residual;
  }

  // One list per StackLinear field: qkv, o, then a dense MLP's gate_up (or up) and down, or a
  // mixture of experts' router, its shared expert's gate_up, down and gate where it has one,
  // and each expert's gate_up and down.
  void set_linears(std::vector<std::optional<at::Tensor>> dense,
                   std::vector<std::optional<at::Tensor>> bias, std::vector<std::string> low_bit,
                   std::vector<std::optional<at::Tensor>> low_a,
                   std::vector<std::optional<at::Tensor>> low_b,
                   std::vector<std::optional<at::Tensor>> low_c,
                   std::vector<std::optional<at::Tensor>> low_d, std::vector<int64_t> out,
                   std::vector<int64_t> max_rows,
                   std::vector<std::optional<at::Tensor>> lora_a,
                   std::vector<std::optional<at::Tensor>> lora_b,
                   std::vector<std::optional<at::Tensor>> lora_used,
                   std::vector<std::vector<int64_t>> lora_bounds) {
    StackLayer& l = building();
    const size_t count = dense.size();
    for (size_t n : {bias.size(), low_bit.size(), low_a.size(), low_b.size(), low_c.size(),
                     low_d.size(), out.size(), max_rows.size(), lora_a.size(), lora_b.size(),
                     lora_used.size(), lora_bounds.size()})
      TORCH_CHECK(n == count, "one entry per linear layer in each of its fields");
    TORCH_CHECK(count >= 4, "a layer has qkv, o and an MLP");
    l.linears.clear();
    for (size_t i = 0; i < count; ++i) {
      l.linears.emplace_back(dense[i], bias[i], low_bit[i], low_a[i], low_b[i], low_c[i],
                             low_d[i], out[i], max_rows[i]);
      TORCH_CHECK(lora_a[i].has_value() == lora_b[i].has_value() &&
                  lora_a[i].has_value() == lora_used[i].has_value(),
                  "LoRA slots come as A, B and their use");
      if (!lora_a[i]) continue;
      TORCH_CHECK(lora_used[i]->scalar_type() == at::kBool && lora_a[i]->dim() == 3 &&
                  lora_b[i]->dim() == 3 && lora_used[i]->size(0) == lora_a[i]->size(0) &&
                  lora_bounds[i].size() >= 2,
                  "LoRA slots: A [slots, width, K], B^T [slots, rank, N], bool used [slots], "
                  "and each packed projection's output bounds");
      l.linears.back().lora_bounds = lora_bounds[i];
      l.linears.back().lora_a = *lora_a[i];
      l.linears.back().lora_b = *lora_b[i];
      l.linears.back().lora_used = *lora_used[i];
    }
  }

  // Llama 4's query temperature in a layer without RoPE (StackLayer.temperature_floor), after
  // add_layer.
  void set_query_temperature(double floor_scale, double attn_scale) {
    StackLayer& l = building();
    TORCH_CHECK(floor_scale > 0 && !l.cos.defined(), "a query temperature takes RoPE's place, "
                "with floor_scale > 0");
    l.temperature_floor = floor_scale;
    l.temperature_scale = attn_scale;
  }

  // Qwen3-Next's attention whose q projection gives each head's query then its output gate
  // (the attention's output times sigmoid(gate)), after add_layer.
  void set_output_gate() {
    StackLayer& l = building();
    TORCH_CHECK(l.k_cache.defined(), "an output gate is an attention layer's");
    l.output_gate = true;
  }

  // Qwen3-Next's linear attention (StackDeltaNet) in place of qkv, in a layer added without a
  // KV cache, between set_linears and set_mlp: it takes the first two linears given
  // (in_proj_qkvz, in_proj_ba); out_proj is the layer's o. conv_weight: [conv_dim, K];
  // chunk: the prompt tokens a triangular solve takes at once; conv_state, ssm_state: the
  // layer's state buffers, moved in place.
  void set_delta_net(bool qkvz_split, at::Tensor conv_weight, at::Tensor a_log,
                     at::Tensor dt_bias, at::Tensor norm_weight, double norm_eps,
                     int64_t k_heads, int64_t v_heads, int64_t dk, int64_t dv, int64_t chunk,
                     at::Tensor conv_state, at::Tensor ssm_state) {
    StackLayer& l = building();
    TORCH_CHECK(!l.k_cache.defined(), "a linear attention layer has no KV cache");
    TORCH_CHECK(l.linears.size() >= 5, "the linear attention's linears come first");
    const int64_t conv_dim = 2 * k_heads * dk + v_heads * dv;
    TORCH_CHECK(k_heads > 0 && v_heads % k_heads == 0 && conv_weight.dim() == 2 &&
                conv_weight.size(0) == conv_dim && conv_state.dim() == 3 &&
                conv_state.size(1) == conv_dim && conv_state.size(2) == conv_weight.size(1) - 1 &&
                ssm_state.scalar_type() == at::kFloat && ssm_state.dim() == 4 &&
                ssm_state.size(0) == conv_state.size(0) && ssm_state.size(1) == v_heads &&
                ssm_state.size(2) == dk && ssm_state.size(3) == dv &&
                a_log.numel() == v_heads && dt_bias.numel() == v_heads &&
                norm_weight.numel() == dv && chunk > 0,
                "a linear attention's conv weight is [2 k_heads d_k + v_heads d_v, K], its states "
                "[rows, conv_dim, K - 1] and float32 [rows, v_heads, d_k, d_v], and v_heads a "
                "multiple of k_heads");
    StackDeltaNet d;
    d.qkvz = l.linears[0];
    d.ba = l.linears[1];
    d.qkvz_split = qkvz_split;
    d.conv_weight = conv_weight;
    d.decay_rate = -a_log.to(at::kFloat).exp();
    d.dt_bias = dt_bias;
    d.norm_weight = norm_weight;
    d.norm_eps = norm_eps;
    d.k_heads = k_heads;
    d.v_heads = v_heads;
    d.dk = dk;
    d.dv = dv;
    d.chunk = chunk;
    d.conv_state = conv_state;
    d.ssm_state = ssm_state;
    l.linears.erase(l.linears.begin(), l.linears.begin() + 2);
    l.delta_net = std::move(d);
  }

  // After set_delta_net, under speculative decoding: where a verified span's inputs wait for
  // the verdict (GatedDeltaNet's span buffers, per batch row).
  void set_delta_net_spans(at::Tensor seq, at::Tensor conv, at::Tensor beta, at::Tensor g) {
    StackLayer& l = building();
    TORCH_CHECK(l.delta_net, "span buffers follow set_delta_net");
    const StackDeltaNet& d = *l.delta_net;
    const int64_t span = conv.size(1);
    TORCH_CHECK(seq.dim() == 3 && seq.size(1) == d.conv_state.size(1) &&
                    seq.size(2) == d.conv_state.size(2) + span && conv.dim() == 3 &&
                    conv.size(2) == seq.size(1) && beta.scalar_type() == at::kFloat &&
                    g.scalar_type() == at::kFloat && beta.sizes() == g.sizes() &&
                    beta.dim() == 3 && beta.size(1) == span && beta.size(2) == d.v_heads,
                "span buffers: seq [rows, conv_dim, K - 1 + span], conv [rows, span, conv_dim], "
                "float32 beta and g [rows, span, v_heads]");
    l.delta_net->span_seq = seq;
    l.delta_net->span_conv = conv;
    l.delta_net->span_beta = beta;
    l.delta_net->span_g = g;
  }

  // DeepSeek's latent attention (StackLatent) in place of qkv, between set_linears and set_mlp:
  // it takes the first linears given (q_a, q_b, kv_a where q_a_norm is given, else q, kv_a).
  // kv_b: [heads * (nope + v_dim), rank], each head's W_UK rows then its W_UV rows.
  void set_latent(std::optional<at::Tensor> q_a_norm, at::Tensor kv_a_norm, double q_a_eps,
                  double kv_a_eps, at::Tensor kv_b, int64_t nope, int64_t rope, int64_t v_dim) {
    StackLayer& l = building();
    StackLatent a;
    a.q_compressed = q_a_norm.has_value();
    const size_t parts = a.q_compressed ? 3 : 2;
    TORCH_CHECK(l.linears.size() >= parts + 3, "the latent attention's linears come first");
    a.rank = head_dim_ - rope;
    TORCH_CHECK(kv_heads_ == 1 && a.rank > 0 && nope > 0 && v_dim > 0 && rope % 2 == 0 &&
                kv_b.dim() == 2 && kv_b.size(0) == heads_ * (nope + v_dim) &&
                kv_b.size(1) == a.rank && kv_b.is_contiguous(),
                "a latent stack has one KV head of rank + rope features, and kv_b is "
                "[heads * (nope + v_dim), rank]");
    TORCH_CHECK(l.cos.defined() && l.cos.size(1) * 2 == rope, "the rotary tables span rope");
    if (a.q_compressed) {
      a.q_a = l.linears[0];
      a.q_a_norm = *q_a_norm;
    }
    a.q = l.linears[parts - 2];
    a.kv_a = l.linears[parts - 1];
    a.kv_a_norm = kv_a_norm;
    a.q_a_eps = q_a_eps;
    a.kv_a_eps = kv_a_eps;
    auto per_head = kv_b.view({heads_, nope + v_dim, a.rank});
    a.w_uk = per_head.narrow(1, 0, nope);
    a.w_uv = per_head.narrow(1, nope, v_dim);
    a.nope = nope;
    a.rope = rope;
    a.v_dim = v_dim;
    l.linears.erase(l.linears.begin(), l.linears.begin() + parts);
    l.latent = std::move(a);
  }

  // A mixture's routing (StackRouting), between set_linears and set_mlp: the layer's MLP is a
  // mixture of experts. correction: float32 [num_experts] or None.
  void set_routing(int64_t top_k, bool renormalize, bool weigh_inputs, const std::string& scoring,
                   const std::string& choose_by, double scale, int64_t groups,
                   int64_t keep_groups, const std::string& group_score,
                   std::optional<at::Tensor> correction) {
    StackLayer& l = building();
    TORCH_CHECK(scoring == "softmax" || scoring == "sigmoid", "scoring: softmax or sigmoid");
    TORCH_CHECK(choose_by == "scores" || choose_by == "logits", "choose_by: scores or logits");
    TORCH_CHECK(group_score == "max" || group_score == "top2", "group_score: max or top2");
    TORCH_CHECK(top_k >= 1 && 1 <= keep_groups && keep_groups <= groups,
                "top_k >= 1, and keep_groups in [1, groups]");
    StackRouting r;
    r.top_k = top_k;
    r.renormalize = renormalize;
    r.weigh_inputs = weigh_inputs;
    r.sigmoid = scoring == "sigmoid";
    r.by_logits = choose_by == "logits";
    r.scale = scale;
    r.groups = groups;
    r.keep_groups = keep_groups;
    r.group_top2 = group_score == "top2";
    if (correction) {
      TORCH_CHECK(correction->scalar_type() == at::kFloat && correction->dim() == 1 &&
                  !r.by_logits, "a correction is float32 [num_experts], for a choice by scores");
      r.correction = *correction;
    }
    l.routing = r;
  }

  // The MLP over the linears given: dense, or a mixture of experts where set_routing was called
  // (shared: its shared expert, none, plain or gated). Completes the layer.
  // act_params: the clamped SwiGLU's alpha and limit (else empty).
  void set_mlp(const std::string& activation, bool gated, const std::string& shared,
               int64_t first_expert, int64_t num_experts, std::optional<at::Tensor> routed,
               std::vector<double> act_params) {
    StackLayer& l = building();
    auto& lin = l.linears;
    // the attention's linears (o alone after a latent or linear attention took its own)
    const bool mixer = l.latent || l.delta_net;
    const size_t first_mlp = mixer ? 1 : 2;
    TORCH_CHECK(lin.size() >= first_mlp + 2, "set_linears comes before set_mlp");
    TORCH_CHECK(l.k_cache.defined() || l.delta_net,
                "a layer without a KV cache computes a linear attention (set_delta_net)");
    l.act = stack_activation(activation);
    l.gated = gated;
    TORCH_CHECK(!gated || l.act == StackActivation::kSilu || l.act == StackActivation::kGeluTanh ||
                    l.act == StackActivation::kClampedSwiglu,
                "a gated MLP takes silu, gelu_tanh or clamped_swiglu");
    TORCH_CHECK(gated || l.act != StackActivation::kClampedSwiglu,
                "the clamped SwiGLU is gated");
    TORCH_CHECK((l.act == StackActivation::kClampedSwiglu) == (act_params.size() == 2),
                "the clamped SwiGLU takes alpha and limit, the others nothing");
    if (act_params.size() == 2) {
      l.act_alpha = act_params[0];
      l.act_limit = act_params[1];
    }
    if (!mixer) l.qkv = lin[0];
    l.o = lin[first_mlp - 1];
    if (!l.routing) {
      TORCH_CHECK(lin.size() == first_mlp + 2 && shared == "none",
                  "a dense MLP has two projections");
      l.gate_up = lin[first_mlp];
      l.down = lin[first_mlp + 1];
    } else {
      StackMoe moe;
      moe.routing = *l.routing;
      moe.router = lin[first_mlp];
      size_t next = first_mlp + 1;
      moe.shared = stack_shared(shared);
      if (moe.shared != StackShared::kNone) {
        const size_t parts = moe.shared == StackShared::kGated ? 3 : 2;
        TORCH_CHECK(lin.size() >= next + parts, "a shared expert has gate_up, down and, where "
                    "gated, its gate");
        moe.shared_gate_up = lin[next];
        moe.shared_down = lin[next + 1];
        if (parts == 3) moe.shared_gate = lin[next + 2];
        next += parts;
      }
      TORCH_CHECK(gated && (lin.size() - next) % 2 == 0 && lin.size() > next,
                  "experts are gated, each with gate_up and down");
      for (; next < lin.size(); next += 2) {
        moe.gate_up.push_back(lin[next]);
        moe.down.push_back(lin[next + 1]);
      }
      const int64_t held = static_cast<int64_t>(moe.gate_up.size());
      TORCH_CHECK(first_expert >= 0 && first_expert + held <= num_experts &&
                  moe.routing.top_k <= num_experts && num_experts % moe.routing.groups == 0,
                  "experts [first_expert, + held) of num_experts, top_k at most num_experts, "
                  "and groups dividing them");
      TORCH_CHECK(!moe.routing.correction.defined() ||
                  moe.routing.correction.numel() == num_experts, "a correction per expert");
      moe.first_expert = first_expert;
      moe.num_experts = num_experts;
      if (routed) {
        TORCH_CHECK(routed->scalar_type() == at::kLong && routed->numel() == num_experts,
                    "routed: int64 [num_experts]");
        moe.routed = *routed;
      }
      l.moe = std::move(moe);
    }
    lin.clear();
    l.complete = true;
  }

  // x: [T, hidden] embeddings of the step's tokens (each plan's token_index maps attention
  // entries to them) -> hidden states before the final norm. plans: the step's plan, then its
  // sliding-window one and its chunked one, each by plan_index (a layer whose plan is past the
  // list reads plan 0). lora_slot: each token's adapter slot (-1: none), and lora_slots the
  // slots in the step (empty: no adapter). state_rows, query_lens: int64 [R], each request's
  // row in the linear attention's states and its tokens in x (requests one after another),
  // where the stack has such layers; state_saves: int64 [n, 3], (request, tokens into its step,
  // state row) where a request's states are copied after that many of its tokens; num_drafts:
  // int64 [R], each request's draft tokens (a span ending in drafts leaves its state and waits
  // in the span buffers).
  at::Tensor forward(at::Tensor x, at::Tensor positions, at::Tensor slot_mapping,
                     std::vector<StackPlan> plans, std::optional<at::Tensor> lora_slot,
                     std::vector<int64_t> lora_slots, std::optional<at::Tensor> state_rows,
                     std::optional<at::Tensor> query_lens, std::optional<at::Tensor> state_saves,
                     std::optional<at::Tensor> num_drafts) const {
    LoraStep lora;
    if (lora_slot && !lora_slots.empty()) lora = {*lora_slot, std::move(lora_slots)};
    TORCH_CHECK(x.is_contiguous() && positions.is_contiguous() && slot_mapping.is_contiguous(),
                "the stack takes contiguous inputs");
    TORCH_CHECK(!plans.empty() && plans.size() <= 3, "one to three attention plans");
    // Named in the profiler as the ops are (the stack calls its kernels directly, not through
    // the dispatcher); free while no profiler runs.
    RECORD_FUNCTION("octavo::DecodeStack.forward", std::vector<c10::IValue>());
    x = x.clone();  // the residual stream, updated in place
    at::Tensor pending;  // the last MLP output, added with the next layer's norm
    for (const StackLayer& l : layers_) TORCH_CHECK(l.complete, "a layer is not complete");
    std::optional<DeltaNetRequests> requests;  // laid out once for every linear attention layer
    if (state_rows && query_lens)
      requests = delta_net_requests(*state_rows, *query_lens, x.size(0), state_saves,
                                    num_drafts);
    for (const StackLayer& l : layers_) {
      auto xn = pending.defined() ? add_norm(l, x, pending, kAttnIn) : norm(l, x, kAttnIn);
      const StackPlan& plan = plans[l.plan < static_cast<int64_t>(plans.size()) ? l.plan : 0];
      TORCH_CHECK(!l.delta_net || requests,
                  "a linear attention layer needs each request's state row and token count");
      auto o = row_parallel(l.o, l.delta_net ? delta_net_step(*l.delta_net, xn, *requests, lora)
                                             : attention(l, xn, positions, slot_mapping, plan,
                                                         lora),
                            lora);
      if (l.norm_w[kAttnOut].defined()) o = norm(l, o, kAttnOut);
      if (l.residual_scale != 1.0) o = o * l.residual_scale;
      at::Tensor mlp_x;
      if (l.parallel_residual) {  // x + attn + mlp(norm(x)): the MLP reads x before attn joins
        mlp_x = norm(l, x, kMlpIn);
        x += o;
      } else {
        mlp_x = add_norm(l, x, o, kMlpIn);
      }
      pending = mlp(l, mlp_x, lora);
      if (l.norm_w[kMlpOut].defined()) pending = norm(l, pending, kMlpOut);
      if (l.residual_scale != 1.0) pending = pending * l.residual_scale;
    }
    if (pending.defined()) x += pending;
    return x;
  }

  // Tensor parallelism: each rank's o and down projections give partial sums, which the op
  // named `op` (the ranks' all-reduce, in place: "ns::name(Tensor(a!) x) -> ()", registered
  // by octavo/distributed/parallel_state.py) adds up before the residual stream takes them.
  void set_all_reduce(const std::string& op) {
    all_reduce_ = c10::Dispatcher::singleton().findSchemaOrThrow(op.c_str(), "");
  }

 private:
  StackLayer& building() {
    TORCH_CHECK(!layers_.empty() && !layers_.back().complete, "add_layer comes first");
    return layers_.back();
  }

  // The layer's attention of xn [T, hidden] over `plan`, its keys and values written first ->
  // [T, heads * head_dim] (a latent attention: [T, heads * v_dim]), the o projection's input.
  at::Tensor attention(const StackLayer& l, const at::Tensor& xn, const at::Tensor& positions,
                       const at::Tensor& slot_mapping, const StackPlan& plan,
                       const LoraStep& lora) const {
    const auto& [token_index, block_table, seq_lens, window] = plan;
    if (l.latent)
      return latent_attention(*l.latent, xn, positions, l.cos, l.sin, l.k_cache, l.v_cache,
                              l.fp8_cache, slot_mapping, token_index, block_table, seq_lens,
                              window, l.scale, heads_, lora);
    const int64_t t = xn.size(0), q_size = heads_ * head_dim_;
    auto qkv = l.qkv(xn, lora);
    at::Tensor gate;
    if (l.output_gate) {  // [query, gate] per head: the queries gathered before k and v
      auto per_head = qkv.narrow(1, 0, 2 * q_size).view({t, heads_, 2, head_dim_});
      gate = per_head.select(2, 1).reshape({t, q_size});
      qkv = at::cat({per_head.select(2, 0).reshape({t, q_size}),
                     qkv.narrow(1, 2 * q_size, qkv.size(1) - 2 * q_size)}, 1);
    }
    auto q = qkv.narrow(1, 0, q_size).view({t, heads_, head_dim_});
    TORCH_CHECK(qkv.stride(1) == 1, "qkv rows must be contiguous");
    if (l.q_norm.defined() && l.qk_norm == StackQkNorm::kHeadLayer) {
      const int64_t kv_size = kv_heads_ * head_dim_;
      head_layer_norm(q, l.q_norm);
      head_layer_norm(qkv.narrow(1, q_size, kv_size).view({t, kv_heads_, head_dim_}), l.k_norm);
    }
    {
      RECORD_FUNCTION("octavo::rope_write_kv", std::vector<c10::IValue>());
      const bool rope = l.cos.defined();
      const bool one_plus = l.norm_kind == StackNormKind::kOnePlus;
      // the kernel's q/k norms are RMS norms (a per-head LayerNorm is applied above)
      const auto& q_norm = l.qk_norm == StackQkNorm::kHeadLayer ? at::Tensor() : l.q_norm;
      const auto& k_norm = l.qk_norm == StackQkNorm::kHeadLayer ? at::Tensor() : l.k_norm;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xn.scalar_type(), "rope_kv",
                                      [&] {
        rope_write_kv_typed<scalar_t>(
            qkv.data_ptr<scalar_t>(), t, qkv.stride(0), heads_, kv_heads_, head_dim_,
            rope ? l.cos.size(1) : 0, positions.data_ptr<int64_t>(),
            rope ? l.cos.data_ptr<float>() : nullptr, rope ? l.sin.data_ptr<float>() : nullptr,
            weight_of<scalar_t>(q_norm, one_plus), weight_of<scalar_t>(k_norm, one_plus),
            l.qk_norm == StackQkNorm::kWhole, static_cast<float>(eps_),
            l.fp8_cache ? nullptr : l.k_cache.data_ptr<scalar_t>(),
            l.fp8_cache ? nullptr : l.v_cache.data_ptr<scalar_t>(),
            slot_mapping.data_ptr<int64_t>());
      });
      if (l.fp8_cache) {
        const int64_t kv_size = kv_heads_ * head_dim_;
        write_fp8_kv(l.k_cache, qkv.narrow(1, q_size, kv_size), slot_mapping, l.k_scale);
        write_fp8_kv(l.v_cache, qkv.narrow(1, q_size + kv_size, kv_size), slot_mapping,
                     l.v_scale);
      }
    }
    if (l.temperature_floor > 0) {  // QueryTemperature's ops, in float32, rounded once
      auto factor = at::floor((positions.to(at::kFloat) + 1.0) / l.temperature_floor).log1p() *
                        l.temperature_scale + 1.0;
      q.copy_(q * factor.view({t, 1, 1}));
    }
    auto attn = at::empty({t, heads_, head_dim_}, xn.options());
    {
      RECORD_FUNCTION("octavo::decode_attention", std::vector<c10::IValue>());
      // An fp8 cache's scales: k_scale folds into the softmax scale, v_scale into the output
      // (paged_attention.py does the same).
      at::Tensor lse;  // each query's log-sum-exp per head, where sinks need it
      if (l.sinks.defined()) lse = at::empty({t, heads_}, xn.options().dtype(at::kFloat));
      decode_attention(attn, q, l.k_cache, l.v_cache, token_index, block_table, seq_lens,
                       l.scale * l.k_scale, l.softcap, window,
                       lse.defined() ? std::optional<at::Tensor>(lse) : std::nullopt);
      if (l.v_scale != 1.0) attn.mul_(l.v_scale);
      // a sink's share of the softmax: the output times sigmoid(lse - sink), in float32 and
      // rounded once (paged_attention.py's order)
      if (l.sinks.defined()) attn.copy_(attn * (lse - l.sinks).sigmoid().unsqueeze(-1));
    }
    if (gate.defined()) return attn.view({t, q_size}) * gate.sigmoid();
    return attn.view({t, q_size});
  }

  // HeadLayerNorm's ops on x [T, heads, head_dim] in place (Cohere's q/k norms): each head's
  // features centred and scaled in float32, times its weight [heads, head_dim], rounded once.
  void head_layer_norm(const at::Tensor& x, const at::Tensor& weight) const {
    auto xf = x.to(at::kFloat);
    xf = xf - xf.mean(-1, true);
    xf = xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps_);
    x.copy_(weight.to(at::kFloat).view({x.size(1), x.size(2)}) * xf);
  }

  static at::Tensor activate(const StackLayer& l, const at::Tensor& h) {
    if (l.gated && l.act == StackActivation::kClampedSwiglu) {  // layers/activation.py's ops
      const int64_t w = h.size(1) / 2;
      auto gate = h.narrow(1, 0, w).clamp_max(l.act_limit);
      auto up = h.narrow(1, w, w).clamp(-l.act_limit, l.act_limit);
      return (up + 1) * (gate * (gate * l.act_alpha).sigmoid());
    }
    if (l.gated)
      return l.act == StackActivation::kGeluTanh ? gelu_tanh_and_mul(h) : silu_and_mul(h);
    switch (l.act) {  // the ATen ops the Python layers' activations call
      case StackActivation::kSilu: return at::silu(h);
      case StackActivation::kGeluTanh: return at::gelu(h, "tanh");
      case StackActivation::kGelu: return at::gelu(h);
      case StackActivation::kRelu: return at::relu(h);
      case StackActivation::kClampedSwiglu: break;  // gated only (set_mlp)
    }
    TORCH_CHECK(false, "unreachable");
  }

  // A projection whose output the ranks sum (o, down): its bias joins after the sum, once, as
  // the Python Linear adds it.
  at::Tensor row_parallel(const StackLinear& lin, const at::Tensor& x,
                          const LoraStep& lora = LoraStep()) const {
    auto y = lin.product(x, lora);  // a partial adapter delta beside the partial product
    reduce(y);
    return lin.add_bias(y);
  }

  // The MLP of xn, summed over the ranks, with each token's adapter delta (on a mixture's
  // experts: each routed row's, of that expert's projections).
  at::Tensor mlp(const StackLayer& l, const at::Tensor& xn,
                 const LoraStep& lora) const {
    if (!l.moe) return row_parallel(l.down, activate(l, l.gate_up(xn, lora)), lora);
    const StackMoe& m = *l.moe;
    RECORD_FUNCTION("octavo::moe", std::vector<c10::IValue>());
    // FusedMoE.forward's ops in its order (the same sums): top-k routing, token rows sorted by
    // expert so that each expert runs one matmul over its rows, weighted and added back.
    const auto& router = m.router;
    auto [weights, experts] = stack_route(
        m.routing, router.dense.defined() && router.dense.scalar_type() != xn.scalar_type()
                       ? router(xn.to(router.dense.scalar_type())) : router(xn));
    auto flat = experts.reshape(-1);
    auto order = flat.argsort(/*stable=*/true);
    auto counts = at::bincount(flat, {}, m.num_experts);
    if (m.routed.defined()) m.routed.add_(counts);
    const int64_t* count = counts.data_ptr<int64_t>() + m.first_expert;  // the held experts'
    const int64_t held = static_cast<int64_t>(m.gate_up.size());
    const int64_t before = counts.narrow(0, 0, m.first_expert).sum().item<int64_t>();
    order = order.narrow(0, before, std::accumulate(count, count + held, int64_t{0}));
    auto token = at::div(order, m.routing.top_k, "floor");
    auto xs = xn.index_select(0, token);
    auto row_weight =
        weights.reshape(-1).index_select(0, order).unsqueeze(1).to(xn.scalar_type());
    if (m.routing.weigh_inputs) xs = xs * row_weight;
    auto ys = at::empty_like(xs);
    const bool adapted = !lora.slots.empty();
    auto row_slot = adapted ? lora.token_slot.index_select(0, token) : at::Tensor();
    int64_t start = 0;
    for (int64_t e = 0; e < held; ++e) {
      if (count[e] == 0) continue;
      const LoraStep rows = adapted ? LoraStep{row_slot.narrow(0, start, count[e]), lora.slots}
                                    : LoraStep();
      ys.narrow(0, start, count[e])
          .copy_(m.down[e](activate(l, m.gate_up[e](xs.narrow(0, start, count[e]), rows)),
                           rows));
      start += count[e];
    }
    if (!m.routing.weigh_inputs) ys = ys * row_weight;
    auto out = at::zeros_like(xn).index_add_(0, token, ys);
    reduce(out);
    if (m.shared == StackShared::kNone) return out;
    auto shared = row_parallel(m.shared_down, activate(l, m.shared_gate_up(xn, lora)), lora);
    return m.shared == StackShared::kGated ? out + m.shared_gate(xn).sigmoid() * shared
                                           : out + shared;
  }

  void reduce(const at::Tensor& partial) const {
    if (!all_reduce_) return;
    torch::jit::Stack stack{partial};  // a Python kernel takes the GIL itself
    all_reduce_->callBoxed(&stack);
  }

  template <typename T>
  static NormWeight<T> weight_of(const at::Tensor& w, bool one_plus) {
    NormWeight<T> n;
    if (!w.defined()) return n;
    if (one_plus)
      n.one_plus = w.data_ptr<float>();
    else
      n.w = w.data_ptr<T>();
    return n;
  }

  // The layer's norm at `place` of x [rows, width] (rows may be apart by more than width: a
  // narrowed projection).
  // Where the layer has no norm at `place`, a copy of x (the residual stream changes in place
  // while the copy is read).
  at::Tensor norm(const StackLayer& l, const at::Tensor& x, StackNormPlace place) const {
    TORCH_CHECK(x.stride(1) == 1);
    if (!l.norm_w[place].defined()) return x.clone();
    if (l.norm_kind == StackNormKind::kLayer)
      return at::layer_norm(x, {x.size(1)}, l.norm_w[place], l.norm_b[place], eps_);
    const bool one_plus = l.norm_kind == StackNormKind::kOnePlus;
    auto out = at::empty({x.size(0), x.size(1)}, x.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "stack_norm", [&] {
      const auto w = weight_of<scalar_t>(l.norm_w[place], one_plus);
      const scalar_t* xp = x.data_ptr<scalar_t>();
      scalar_t* op = out.data_ptr<scalar_t>();
      const int64_t width = x.size(1), stride = x.stride(0);
      at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          norm_row(w, xp + r * stride, op + r * width, width, static_cast<float>(eps_));
      });
    });
    return out;
  }

  // x += delta in place; returns the layer's norm at `place` of x.
  at::Tensor add_norm(const StackLayer& l, at::Tensor& x, const at::Tensor& delta,
                      StackNormPlace place) const {
    TORCH_CHECK(delta.stride(1) == 1 && delta.scalar_type() == x.scalar_type());
    if (l.norm_kind == StackNormKind::kLayer || !l.norm_w[place].defined()) {
      x += delta;
      return norm(l, x, place);
    }
    const bool one_plus = l.norm_kind == StackNormKind::kOnePlus;
    auto out = at::empty_like(x);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_norm", [&] {
      add_rms_norm_typed<scalar_t>(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(),
                                   delta.stride(0), weight_of<scalar_t>(l.norm_w[place], one_plus),
                                   out.data_ptr<scalar_t>(), x.size(0), x.size(1),
                                   static_cast<float>(eps_));
    });
    return out;
  }

  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  std::vector<StackLayer> layers_;
  std::optional<c10::OperatorHandle> all_reduce_;
};
