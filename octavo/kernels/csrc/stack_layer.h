// What one decoder layer of DecodeStack (decode_stack.h) is: its norms, linear layers, MLP (dense
// or a mixture of experts), attention settings and cache, each named by the value the Python side
// gives it (octavo/model/layer_spec.py, LayerSpec). Included by decode_stack.cpp only, after
// stack_linear.h.
#pragma once

#include <array>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "stack_delta_net.h"
#include "stack_latent.h"

// How a layer's norms apply their weights: RMSNorm (x / rms(x) * w, rounded to the dtype first),
// Gemma's (1 + w in float32, one rounding), or LayerNorm with a bias (GPT-NeoX, GPT-2) or
// without (Cohere).
enum class StackNormKind { kRms, kOnePlus, kLayer };

inline StackNormKind stack_norm_kind(const std::string& name) {
  if (name == "rms") return StackNormKind::kRms;
  if (name == "one_plus") return StackNormKind::kOnePlus;
  if (name == "layer") return StackNormKind::kLayer;
  TORCH_CHECK(false, "unknown norm kind '", name, "' (rms, one_plus, layer)");
}

// How a layer's q/k norms apply: RMS norms per head (Qwen3, Gemma 3) or over all of a token's
// heads (OLMo 2), or LayerNorms per head with a weight per head (Cohere).
enum class StackQkNorm { kHead, kWhole, kHeadLayer };

inline StackQkNorm stack_qk_norm(const std::string& name) {
  if (name == "head") return StackQkNorm::kHead;
  if (name == "whole") return StackQkNorm::kWhole;
  if (name == "head_layer") return StackQkNorm::kHeadLayer;
  TORCH_CHECK(false, "unknown q/k norm '", name, "' (head, whole, head_layer)");
}

// The MLP's activation: on a packed [gate | up] projection where gated (silu, gelu_tanh and
// gpt-oss's clamped SwiGLU), else on the up projection alone.
enum class StackActivation { kSilu, kGeluTanh, kGelu, kRelu, kClampedSwiglu };

inline StackActivation stack_activation(const std::string& name) {
  if (name == "silu") return StackActivation::kSilu;
  if (name == "gelu_tanh") return StackActivation::kGeluTanh;
  if (name == "gelu") return StackActivation::kGelu;
  if (name == "relu") return StackActivation::kRelu;
  if (name == "clamped_swiglu") return StackActivation::kClampedSwiglu;
  TORCH_CHECK(false, "unknown activation '", name,
              "' (silu, gelu_tanh, gelu, relu, clamped_swiglu)");
}

// Which of forward's plans a layer's attention reads: the step's, the sliding-window one, or the
// chunked one (Llama 4's local layers).
inline int64_t plan_index(const std::string& name) {
  if (name == "step") return 0;
  if (name == "sliding") return 1;
  if (name == "chunked") return 2;
  TORCH_CHECK(false, "unknown attention plan '", name, "' (step, sliding, chunked)");
}

// How a mixture routes a token (octavo/model/layers/routing.py, Routing): softmax or sigmoid
// scores of the float32 logits; the top-k of the scores (plus a correction bias where given) or
// of the logits, within the keep_groups best of `groups` groups of experts (a group scored by its
// best expert or its best two); the chosen scores, renormalized where asked, times `scale`.
struct StackRouting {
  int64_t top_k = 1;
  bool renormalize = false;
  bool weigh_inputs = false;  // a row's weight scales its expert's input, not its output
  bool sigmoid = false;
  bool by_logits = false;
  double scale = 1.0;
  int64_t groups = 1, keep_groups = 1;
  bool group_top2 = false;
  at::Tensor correction;  // float32 [num_experts], or undefined
};

// Routing.__call__'s ops: router logits [T, E] -> (weights float32, experts) [T, top_k].
inline std::tuple<at::Tensor, at::Tensor> stack_route(const StackRouting& r,
                                                     const at::Tensor& logits) {
  auto floats = logits.to(at::kFloat);
  auto scores = r.sigmoid ? floats.sigmoid() : floats.softmax(-1);
  auto choice = r.by_logits ? logits
                            : r.correction.defined() ? scores + r.correction : scores;
  if (r.groups > 1) {  // the experts outside the keep_groups best groups set to -inf
    const int64_t t = choice.size(0), per_group = choice.size(1) / r.groups;
    auto by_group = choice.view({t, r.groups, per_group});
    auto score = r.group_top2 ? std::get<0>(by_group.topk(2, -1)).sum(-1)
                              : by_group.amax(-1);
    auto best = std::get<1>(score.topk(r.keep_groups, -1));
    auto kept = at::zeros_like(score, score.options().dtype(at::kBool))
                    .scatter_(1, best, true);
    choice = choice.masked_fill(kept.logical_not().repeat_interleave(per_group, 1),
                                -std::numeric_limits<double>::infinity());
  }
  auto experts = std::get<1>(choice.topk(r.top_k, -1));
  auto weights = scores.gather(1, experts);
  if (r.renormalize) weights = weights / (weights.sum(-1, true) + 1e-20);
  if (r.scale != 1.0) weights = weights * r.scale;
  return {weights, experts};
}

// A mixture's shared expert: none, added as it is (DeepSeek), or gated by a sigmoid (Qwen2-MoE).
enum class StackShared { kNone, kPlain, kGated };

inline StackShared stack_shared(const std::string& name) {
  if (name == "none") return StackShared::kNone;
  if (name == "plain") return StackShared::kPlain;
  if (name == "gated") return StackShared::kGated;
  TORCH_CHECK(false, "unknown shared expert '", name, "' (none, plain, gated)");
}

// A mixture-of-experts MLP (octavo/model/layers/moe.py FusedMoE, with a shared expert).
struct StackMoe {
  StackLinear router;  // its dense weight may be float32 beside activations of another dtype
  std::vector<StackLinear> gate_up, down;  // per expert
  StackRouting routing;
  // gate_up and down are experts [first_expert, + size) of num_experts: under expert
  // parallelism this rank's, the others' rows left to their ranks
  int64_t first_expert = 0, num_experts = 0;
  at::Tensor routed;  // int64 [num_experts]: rows routed to each expert, added up; or undefined
  StackShared shared = StackShared::kNone;  // shared_down(act(shared_gate_up)), times
  StackLinear shared_gate_up, shared_down, shared_gate;  // sigmoid(shared_gate) where gated
};

// The norms of a layer by place.
enum StackNormPlace { kAttnIn = 0, kAttnOut = 1, kMlpIn = 2, kMlpOut = 3 };

struct StackLayer {
  StackNormKind norm_kind = StackNormKind::kRms;
  // Weights (and LayerNorm's biases) of the norms before each sublayer and after each, where
  // the layer has them (undefined: none; Gemma has all four, OLMo 2 only those after):
  // 1 + w in float32 for kOnePlus.
  std::array<at::Tensor, 4> norm_w, norm_b;
  at::Tensor q_norm, k_norm;  // before the rotation (Qwen3, Gemma 3, OLMo 2, Cohere), else
  StackQkNorm qk_norm = StackQkNorm::kHead;  // undefined; how they apply
  bool parallel_residual = false;  // the MLP reads the layer's input, as attention does (NeoX)
  double residual_scale = 1.0;     // each sublayer's output times this before the add (Granite)
  StackLinear qkv, o, gate_up, down;  // gate_up and down: a dense MLP's
  std::optional<StackLatent> latent;  // DeepSeek's latent attention in qkv's place, else none
  std::optional<StackDeltaNet> delta_net;  // Qwen3-Next's linear attention in its place, else
  // none (the layer has no KV cache)
  bool output_gate = false;  // qkv gives each head's query then its gate: out * sigmoid(gate)
  std::optional<StackMoe> moe;        // else the mixture of experts
  std::optional<StackRouting> routing;  // a mixture's, from set_routing until set_mlp
  bool gated = true;
  StackActivation act = StackActivation::kSilu;
  double act_alpha = 0.0, act_limit = 0.0;  // the clamped SwiGLU's
  at::Tensor k_cache, v_cache;  // [num_blocks, block_size, kv_heads, head_dim]
  bool fp8_cache = false;       // float8_e4m3fn K/V: k / k_scale and v / v_scale stored
  double k_scale = 1.0, v_scale = 1.0;
  at::Tensor cos, sin;  // RoPE tables [positions, rotary_dim / 2] float32; undefined: no RoPE
  double scale = 1.0, softcap = 0.0;  // softcap 0: none
  // Llama 4's layers without RoPE: queries times log1p(floor((p + 1) / floor)) * scale + 1 at
  // position p (rotary.QueryTemperature); floor 0: none
  double temperature_floor = 0.0, temperature_scale = 0.0;
  at::Tensor sinks;  // float32 [heads]: a logit per head in each softmax's denominator (gpt-oss)
  int64_t plan = 0;  // which of forward's plans its attention reads (1: the sliding-window one)
  std::vector<StackLinear> linears;  // as given, until set_mlp places them
  bool complete = false;  // set_mlp was called: the layer is whole
};
