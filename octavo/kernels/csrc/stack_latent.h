// DeepSeek's multi-head latent attention as a layer of DecodeStack (decode_stack.h): the ops of
// octavo/model/layers/mla.py (MlaAttention.forward) in its order, up to the o projection's
// input. The cache holds one latent row a token (the RMS-normalized compressed KV, then the key's
// rotated part shared by every head), read as both K and V; each head's query is taken into the
// latent space by its key projection (W_UK) and its output out of it by its value projection
// (W_UV). Included by decode_stack.cpp only, after stack_linear.h.
#pragma once

// The latent attention's weights and sizes (octavo/model/layer_spec.py, LatentSpec).
struct StackLatent {
  bool q_compressed = false;  // q = q_b(norm(q_a(x))) (V3), else q = q_proj(x) (V2-Lite)
  StackLinear q_a, q, kv_a;   // q: q_b_proj or q_proj
  at::Tensor q_a_norm, kv_a_norm;  // RMSNorm weights (q_a_norm: where compressed)
  double q_a_eps = 1e-6, kv_a_eps = 1e-6;
  at::Tensor w_uk, w_uv;  // views of kv_b_proj's weight: [heads, nope, rank], [heads, v, rank]
  int64_t nope = 0, rope = 0, v_dim = 0, rank = 0;
};

// xn [T, hidden] (the layer's normed input) -> [T, heads * v_dim], the o projection's input.
// Writes the step's latent rows to `cache`'s slots (k_cache; v_cache is the same storage)
// and attends over the plan's entries with `scale`.
inline at::Tensor latent_attention(const StackLatent& a, const at::Tensor& xn,
                                   const at::Tensor& positions, const at::Tensor& cos,
                                   const at::Tensor& sin, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, bool fp8_cache,
                                   const at::Tensor& slot_mapping, const at::Tensor& token_index,
                                   const at::Tensor& block_table, const at::Tensor& seq_lens,
                                   int64_t window, double scale, int64_t heads,
                                   const LoraStep& lora) {
  RECORD_FUNCTION("octavo::latent_attention", std::vector<c10::IValue>());
  const int64_t t = xn.size(0), width = a.rank + a.rope;
  auto q = a.q_compressed
               ? a.q(rms_norm(a.q_a(xn, lora).contiguous(), a.q_a_norm, a.q_a_eps), lora)
               : a.q(xn, lora);
  auto heads_q = q.view({t, heads, a.nope + a.rope});
  auto q_rope = heads_q.narrow(2, a.nope, a.rope).contiguous();
  auto kv = a.kv_a(xn, lora);
  auto latent = rms_norm(kv.narrow(1, 0, a.rank).contiguous(), a.kv_a_norm, a.kv_a_eps);
  auto k_rope = kv.narrow(1, a.rank, a.rope).contiguous().view({t, 1, a.rope});
  rotary_inplace(q_rope, positions, cos, sin);
  rotary_inplace(k_rope, positions, cos, sin);
  auto q_latent = at::einsum("thn,hnr->thr", {heads_q.narrow(2, 0, a.nope), a.w_uk});
  auto row = at::cat({latent, k_rope.view({t, a.rope})}, -1).view({t, 1, width});
  if (fp8_cache)  // one write: K and V are the same storage (a latent row has no cache scale)
    write_fp8_kv(k_cache, row, slot_mapping, 1.0);
  else
    write_kv(row, row, k_cache, v_cache, slot_mapping);
  auto query = at::cat({q_latent, q_rope}, -1);
  auto out = at::empty_like(query);
  decode_attention(out, query, k_cache, v_cache, token_index, block_table, seq_lens, scale, 0.0,
                   window);
  return at::einsum("thr,hvr->thv", {out.narrow(2, 0, a.rank), a.w_uv})
      .reshape({t, heads * a.v_dim});
}
