// DecodeStack: the decoder layers of a Llama- or Gemma-family model for a step whose attention
// the in-place kernel takes whole (decodes, short queries, prompts: one attention entry per query
// token), as one call: the same kernels the Python layers call, without a Python frame and a
// dozen dispatches per layer around each of them (about 3 ms a step for a 30-layer model, a
// third of a batch-1 decode step). octavo/model/decode_stack.py builds it from each layer's
// description (octavo/model/layer_spec.py) and checks what it supports.
// Included by cpu_ops.cpp after the kernels and StackLinear it calls (one translation unit).
#pragma once

#include <ATen/record_function.h>

// The gated activation of a layer's MLP, by layer_spec.Activation's names.
enum class StackActivation { kSilu, kGeluTanh };

inline StackActivation stack_activation(const std::string& name) {
  if (name == "silu") return StackActivation::kSilu;
  if (name == "gelu_tanh") return StackActivation::kGeluTanh;
  TORCH_CHECK(false, "unknown gated activation '", name, "' (silu, gelu_tanh)");
}

// Which of forward's plans a layer's attention reads: the step's, or the sliding-window one.
inline int64_t plan_index(const std::string& name) {
  if (name == "step") return 0;
  if (name == "sliding") return 1;
  TORCH_CHECK(false, "unknown attention plan '", name, "' (step, sliding)");
}

// One attention plan of a step as the kernel reads it (paged_attention.DecodeGroup): the
// entries' tokens, their requests' block tables and context lengths, and the plan's window
// (0: none).
using StackPlan = std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t>;

// A mixture-of-experts MLP (octavo/model/layers/moe.py FusedMoE, and Qwen2-MoE's sigmoid-gated
// shared expert), computed with the ops FusedMoE.forward calls, in its order: the same sums.
struct StackMoe {
  StackLinear router;
  std::vector<StackLinear> gate_up, down;  // per expert
  int64_t top_k = 1;
  bool renormalize = false;
  bool shared = false;  // a shared expert: shared_down(act(shared_gate_up)) * sigmoid(gate)
  StackLinear shared_gate_up, shared_down, shared_gate;
};

struct StackLayer {
  // Norms: w in the activation dtype, or 1 + w in float32 where one_plus_norms (Gemma).
  // attn_out / mlp_out: the norms after each sublayer (Gemma's sandwich), else undefined;
  // q_norm / k_norm: per head before the rotation (Qwen3, Gemma 3), else undefined.
  at::Tensor attn_in, attn_out, mlp_in, mlp_out, q_norm, k_norm;
  bool one_plus_norms = false;
  StackLinear qkv, o, gate_up, down;  // gate_up and down: a dense MLP's
  std::optional<StackMoe> moe;         // else the mixture of experts
  at::Tensor k_cache, v_cache;  // [num_blocks, block_size, kv_heads, head_dim]
  at::Tensor cos, sin;  // this layer's RoPE tables [positions, rotary_dim / 2], float32
  double scale = 1.0, softcap = 0.0;  // softcap 0: none
  int64_t plan = 0;  // which of forward's plans its attention reads (1: the sliding-window one)
  StackActivation act = StackActivation::kSilu;
};

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps) {}

  // norms: [attn_in, attn_out or None, mlp_in, mlp_out or None]. The linears are given as one
  // list per StackLinear field: qkv, o, then a dense MLP's gate_up and down (top_k 0), or a
  // mixture of experts' router, its shared expert's gate_up, down and gate where it has one,
  // and each expert's gate_up and down.
  void add_layer(std::vector<std::optional<at::Tensor>> norms, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, bool one_plus_norms,
                 std::vector<std::optional<at::Tensor>> dense,
                 std::vector<std::optional<at::Tensor>> bias, std::vector<std::string> low_bit,
                 std::vector<std::optional<at::Tensor>> low_a,
                 std::vector<std::optional<at::Tensor>> low_b, std::vector<int64_t> out,
                 std::vector<int64_t> max_rows, at::Tensor kv_cache, at::Tensor cos,
                 at::Tensor sin, double scale, double softcap, std::string plan,
                 std::string activation, int64_t top_k, bool renormalize, bool shared_expert) {
    TORCH_CHECK(norms.size() == 4 && norms[0] && norms[2], "a layer has norms before sublayers");
    const size_t count = dense.size();
    for (size_t n : {bias.size(), low_bit.size(), low_a.size(), low_b.size(), out.size(),
                     max_rows.size()})
      TORCH_CHECK(n == count, "one entry per linear layer in each of its fields");
    const size_t mlp_linears = count - 2;
    TORCH_CHECK(count >= 4 && (top_k > 0 || count == 4) &&
                (top_k == 0 || (mlp_linears - 1 - (shared_expert ? 3 : 0)) % 2 == 0),
                "a layer has qkv and o, then gate_up and down or a router and experts");
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv cache must be [2, ...]");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
                cos.size(1) * 2 <= head_dim_,
                "rotary tables must be float32 [P, rotary_dim / 2], rotary_dim <= head_dim");
    std::vector<StackLinear> linears;
    for (size_t i = 0; i < count; ++i)
      linears.emplace_back(dense[i], bias[i], low_bit[i], low_a[i], low_b[i], out[i],
                           max_rows[i]);
    StackLayer l;
    l.attn_in = *norms[0];
    if (norms[1]) l.attn_out = *norms[1];
    l.mlp_in = *norms[2];
    if (norms[3]) l.mlp_out = *norms[3];
    if (q_norm) l.q_norm = *q_norm;
    if (k_norm) l.k_norm = *k_norm;
    l.one_plus_norms = one_plus_norms;
    for (const auto& n : {l.attn_in, l.attn_out, l.mlp_in, l.mlp_out, l.q_norm, l.k_norm})
      TORCH_CHECK(!n.defined() || (n.is_contiguous() &&
                                   (!one_plus_norms || n.scalar_type() == at::kFloat)),
                  "norm weights must be contiguous (1 + w: float32)");
    l.qkv = linears[0];
    l.o = linears[1];
    if (top_k == 0) {
      l.gate_up = linears[2];
      l.down = linears[3];
    } else {
      StackMoe moe;
      moe.router = linears[2];
      size_t next = 3;
      moe.shared = shared_expert;
      if (shared_expert) {
        moe.shared_gate_up = linears[3];
        moe.shared_down = linears[4];
        moe.shared_gate = linears[5];
        next = 6;
      }
      for (; next < count; next += 2) {
        moe.gate_up.push_back(linears[next]);
        moe.down.push_back(linears[next + 1]);
      }
      TORCH_CHECK(top_k <= static_cast<int64_t>(moe.gate_up.size()),
                  "top_k exceeds the number of experts");
      moe.top_k = top_k;
      moe.renormalize = renormalize;
      l.moe = std::move(moe);
    }
    l.k_cache = kv_cache[0];
    l.v_cache = kv_cache[1];
    check_cache(l.k_cache, l.v_cache);
    l.cos = std::move(cos);
    l.sin = std::move(sin);
    l.scale = scale;
    l.softcap = softcap;
    l.plan = plan_index(plan);
    l.act = stack_activation(activation);
    layers_.push_back(std::move(l));
  }

  // x: [T, hidden] embeddings of the step's tokens (each plan's token_index maps attention
  // entries to them) -> hidden states before the final norm. plans: the step's plan, then the
  // sliding-window one where the step has it (a layer that reads plan 1 reads plan 0 without
  // it, as PagedAttention does).
  at::Tensor forward(at::Tensor x, at::Tensor positions, at::Tensor slot_mapping,
                        std::vector<StackPlan> plans) const {
    const int64_t t = x.size(0);
    const int64_t q_size = heads_ * head_dim_;
    TORCH_CHECK(x.is_contiguous() && positions.is_contiguous() && slot_mapping.is_contiguous(),
                "the stack takes contiguous inputs");
    TORCH_CHECK(!plans.empty() && plans.size() <= 2, "one or two attention plans");
    // Named in the profiler as the ops are (the stack calls its kernels directly, not through
    // the dispatcher); free while no profiler runs.
    RECORD_FUNCTION("octavo::DecodeStack.forward", std::vector<c10::IValue>());
    x = x.clone();  // the residual stream, updated in place
    at::Tensor pending;  // the last MLP output, added with the next layer's norm
    for (const StackLayer& l : layers_) {
      auto xn = pending.defined() ? add_norm(x, pending, l.attn_in, l.one_plus_norms)
                                  : norm(x, l.attn_in, l.one_plus_norms);
      auto qkv = l.qkv(xn);
      auto q = qkv.narrow(1, 0, q_size).view({t, heads_, head_dim_});
      TORCH_CHECK(qkv.stride(1) == 1, "qkv rows must be contiguous");
      {
        RECORD_FUNCTION("octavo::rope_write_kv", std::vector<c10::IValue>());
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_kv",
                                        [&] {
          rope_write_kv_typed<scalar_t>(
              qkv.data_ptr<scalar_t>(), t, qkv.stride(0), heads_, kv_heads_, head_dim_,
              l.cos.size(1), positions.data_ptr<int64_t>(), l.cos.data_ptr<float>(), l.sin.data_ptr<float>(),
              weight_of<scalar_t>(l.q_norm, l.one_plus_norms),
              weight_of<scalar_t>(l.k_norm, l.one_plus_norms), static_cast<float>(eps_),
              l.k_cache.data_ptr<scalar_t>(), l.v_cache.data_ptr<scalar_t>(),
              slot_mapping.data_ptr<int64_t>());
        });
      }
      const auto& [token_index, block_table, seq_lens, window] =
          plans[l.plan < static_cast<int64_t>(plans.size()) ? l.plan : 0];
      auto attn = at::empty({t, heads_, head_dim_}, x.options());
      {
        RECORD_FUNCTION("octavo::decode_attention", std::vector<c10::IValue>());
        decode_attention(attn, q, l.k_cache, l.v_cache, token_index, block_table, seq_lens,
                         l.scale, l.softcap, window);
      }
      auto o = l.o(attn.view({t, q_size}));
      reduce(o);
      if (l.attn_out.defined()) o = norm(o, l.attn_out, l.one_plus_norms);
      pending = mlp(l, add_norm(x, o, l.mlp_in, l.one_plus_norms));
      if (l.mlp_out.defined()) pending = norm(pending, l.mlp_out, l.one_plus_norms);
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
  static at::Tensor activate(const StackLayer& l, const at::Tensor& h) {
    return l.act == StackActivation::kGeluTanh ? gelu_tanh_and_mul(h) : silu_and_mul(h);
  }

  // The MLP of xn, summed over the ranks.
  at::Tensor mlp(const StackLayer& l, const at::Tensor& xn) const {
    if (!l.moe) {
      auto out = l.down(activate(l, l.gate_up(xn)));
      reduce(out);
      return out;
    }
    const StackMoe& m = *l.moe;
    RECORD_FUNCTION("octavo::moe", std::vector<c10::IValue>());
    // Top-k routing; token rows sorted by expert, so each expert runs one matmul over its rows.
    auto probs = m.router(xn).to(at::kFloat).softmax(-1);
    auto [weights, experts] = probs.topk(m.top_k, -1);
    if (m.renormalize) weights = weights / weights.sum(-1, true);
    auto flat = experts.reshape(-1);
    auto order = flat.argsort(/*stable=*/true);
    auto token = at::div(order, m.top_k, "floor");
    auto counts = at::bincount(flat, {}, static_cast<int64_t>(m.gate_up.size()));
    const int64_t* count = counts.data_ptr<int64_t>();
    auto xs = xn.index_select(0, token);
    auto ys = at::empty_like(xs);
    int64_t start = 0;
    for (size_t e = 0; e < m.gate_up.size(); ++e) {
      if (count[e] == 0) continue;
      ys.narrow(0, start, count[e])
          .copy_(m.down[e](activate(l, m.gate_up[e](xs.narrow(0, start, count[e])))));
      start += count[e];
    }
    ys = ys * weights.reshape(-1).index_select(0, order).unsqueeze(1).to(xn.scalar_type());
    auto out = at::zeros_like(xn).index_add_(0, token, ys);
    reduce(out);
    if (!m.shared) return out;
    auto shared = m.shared_down(activate(l, m.shared_gate_up(xn)));
    reduce(shared);
    return out + m.shared_gate(xn).sigmoid() * shared;
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

  // A norm of x [rows, width] (rows may be apart by more than width: a narrowed projection).
  at::Tensor norm(const at::Tensor& x, const at::Tensor& weight, bool one_plus) const {
    TORCH_CHECK(x.stride(1) == 1);
    auto out = at::empty({x.size(0), x.size(1)}, x.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "stack_norm", [&] {
      const auto w = weight_of<scalar_t>(weight, one_plus);
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

  // x += delta in place; returns the norm of x with `weight`.
  at::Tensor add_norm(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                         bool one_plus) const {
    TORCH_CHECK(delta.stride(1) == 1 && delta.scalar_type() == x.scalar_type());
    auto out = at::empty_like(x);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_norm", [&] {
      add_rms_norm_typed<scalar_t>(x.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(),
                                   delta.stride(0), weight_of<scalar_t>(weight, one_plus),
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
