// The kernels' entry points that cross translation units: defined in cpu_ops.cpp (and the
// headers it includes), called by DecodeStack (decode_stack.cpp). The two files compile in
// parallel; a call between them costs no more than the dispatcher call the Python layers make.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

// The cache pair's layout: contiguous [num_blocks, block_size, kv_heads, head_dim], one dtype.
void check_cache(const at::Tensor& kc, const at::Tensor& vc);
void write_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
              at::Tensor slot_mapping);
void write_fp8_kv(const at::Tensor& cache, const at::Tensor& rows, const at::Tensor& slots,
                  double scale);
void decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                      at::Tensor token_index, at::Tensor block_table, at::Tensor seq_lens,
                      double scale, double softcap, int64_t window,
                      const std::optional<at::Tensor>& lse = std::nullopt);

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor one_plus_rms_norm(at::Tensor x, at::Tensor plus_one, double eps);
void rotary_inplace(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin);
at::Tensor silu_and_mul(at::Tensor x);
at::Tensor gelu_tanh_and_mul(at::Tensor x);

at::Tensor int4_gemm(at::Tensor x, at::Tensor q4, at::Tensor sz,
                     std::optional<at::Tensor> high);
at::Tensor int4_int8_gemm(at::Tensor x, at::Tensor q4, at::Tensor sz,
                          std::optional<at::Tensor> high);
at::Tensor int4_int16_gemm(at::Tensor x, at::Tensor q4, at::Tensor sz,
                           std::optional<at::Tensor> high);
at::Tensor int4_tiled_linear(const at::Tensor& x, const at::Tensor& q4, const at::Tensor& sz,
                             const std::optional<at::Tensor>& high);
at::Tensor int8_gemv(at::Tensor x, at::Tensor q, at::Tensor scale);
at::Tensor int8_tiled_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale);
at::Tensor microscaled_gemv(at::Tensor x, at::Tensor codes, at::Tensor scales,
                            at::Tensor code_lut, at::Tensor scale_lut, int64_t block);
at::Tensor microscaled_tiled_linear(at::Tensor x, at::Tensor codes, at::Tensor scales,
                                    at::Tensor code_lut, at::Tensor scale_lut, int64_t block);

// LoRA deltas of a step's tokens, y += B (A x) by each token's slot (lora.h), and the prefetch
// of one slot's A and B.
void lora_apply(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
                const std::vector<int64_t>& bounds, const at::Tensor& used,
                const at::Tensor& token_slot);
void lora_prefetch(const at::Tensor& a, const at::Tensor& b, int64_t slot);
at::Tensor delta_rule_step(at::Tensor state, const at::Tensor& rows, const at::Tensor& q,
                           const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
                           const at::Tensor& g);
