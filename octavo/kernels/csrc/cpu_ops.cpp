// Fused CPU kernels for the decode hot path. Each one replaces a chain of small ATen calls whose
// dispatch cost, not arithmetic, dominates a decode step of a small model. Every kernel has a
// pure-PyTorch twin in octavo/kernels/fused.py that the tests compare it with.
// The kernels live in the headers beside this file; here are their entry points (ops.h names
// those DecodeStack calls) and their registration with PyTorch's dispatcher (TORCH_LIBRARY:
// torch.ops.octavo.*, seen by the profiler and the compiler). DecodeStack, the decoder layers of
// a step in one call, is the library's other translation unit (decode_stack.cpp): the two
// compile in parallel.
#include <torch/library.h>

#include "ops.h"

#include "dequant.h"
#include "delta_rule.h"
#include "panel_gemm.h"
#include "int4_gemm.h"
#include "int4_int8_gemm.h"
#include "int4_int16_avx2.h"
#include "int8_gemm.h"
#include "layer_ops.h"
#include "lora.h"
#include "microscaled.h"
#include "paged_attention.h"

void check_cache(const at::Tensor& kc, const at::Tensor& vc) {
  TORCH_CHECK(kc.dim() == 4 && kc.is_contiguous() && vc.is_contiguous(),
              "cache must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(kc.scalar_type() == vc.scalar_type(), "K and V caches differ in dtype");
}

void write_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
              at::Tensor slot_mapping) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t n = slot_mapping.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "write_kv_c",
                                  [&] { write_kv_typed<scalar_t>(k, v, k_cache, v_cache, slots, n); });
}

// rows [T, kv_heads * head_dim] (or [T, kv_heads, head_dim]) to the slots of an fp8 cache
// [num_blocks, block_size, kv_heads, head_dim] as x / scale, saturated at the e4m3 range:
// fused.write_kv's ops, so the cache holds the same bytes (the stack's layers call it).
void write_fp8_kv(const at::Tensor& cache, const at::Tensor& rows, const at::Tensor& slots,
                  double scale) {
  constexpr double kFp8Max = 448.0;
  const int64_t kv_heads = cache.size(2), head_dim = cache.size(3);
  auto x8 = (rows.to(at::kFloat).reshape({rows.size(0), kv_heads, head_dim}) / scale)
                .clamp(-kFp8Max, kFp8Max)
                .to(at::kFloat8_e4m3fn);
  cache.view({-1, kv_heads, head_dim}).view(at::kByte).index_copy_(0, slots, x8.view(at::kByte));
}

void decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache,
                      at::Tensor v_cache, at::Tensor token_index, at::Tensor block_table,
                      at::Tensor seq_lens, double scale, double softcap, int64_t window,
                      const std::optional<at::Tensor>& lse) {
  check_cache(k_cache, v_cache);
  float* lse_out = nullptr;  // each query's log-sum-exp per head, [tokens, heads] (optional)
  if (lse.has_value()) {
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->is_contiguous() &&
                lse->dim() == 2 && lse->size(0) == q.size(0) && lse->size(1) == q.size(1),
                "lse must be a contiguous float32 [tokens, heads]");
    lse_out = lse->data_ptr<float>();
  }
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "out and q differ in dtype");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  if (q.size(1) / k_cache.size(2) > kMaxGroup) {
    // One KV head read by more query heads than a pass holds (DeepSeek V3's latent attention
    // has 128): the heads in passes of kMaxGroup over the same keys.
    TORCH_CHECK(k_cache.size(2) == 1 && !lse.has_value(),
                "more than ", kMaxGroup, " query heads per KV head need one KV head, no lse");
    for (int64_t h = 0; h < q.size(1); h += kMaxGroup) {
      const int64_t n = std::min(kMaxGroup, q.size(1) - h);
      decode_attention(out.narrow(1, h, n), q.narrow(1, h, n), k_cache, v_cache, token_index,
                       block_table, seq_lens, scale, softcap, window);
    }
    return;
  }
  TORCH_CHECK(token_index.is_contiguous() && seq_lens.is_contiguous() &&
              block_table.stride(1) == 1, "index tensors must be contiguous");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_q", [&] {
    using q_t = scalar_t;
    if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {  // fp8 cache: the caller folds in scales
      decode_attention_typed<q_t, c10::Float8_e4m3fn>(out, q, k_cache, v_cache, token_index,
                                                      block_table, seq_lens, scale, softcap,
                                                      window, lse_out);
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "decode_c",
                                    [&] {
      decode_attention_typed<q_t, scalar_t>(out, q, k_cache, v_cache, token_index, block_table,
                                            seq_lens, scale, softcap, window, lse_out);
    });
  });
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm needs contiguous inputs");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm weight dtype differs");
  auto flat = x.view({-1, x.size(-1)});
  auto out = at::empty_like(flat);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_typed<scalar_t>(out, flat, weight, eps);
  });
  return out.view(x.sizes());
}

at::Tensor one_plus_rms_norm(at::Tensor x, at::Tensor plus_one, double eps) {
  TORCH_CHECK(x.is_contiguous() && plus_one.is_contiguous() &&
              plus_one.scalar_type() == at::kFloat && plus_one.numel() == x.size(-1),
              "one_plus_rms_norm needs contiguous x and 1 + w in float32, one per column");
  auto flat = x.view({-1, x.size(-1)});
  auto out = at::empty_like(flat);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "one_plus_rms_norm",
                                  [&] { one_plus_rms_norm_typed<scalar_t>(out, flat, plus_one, eps); });
  return out.view(x.sizes());
}

void rotary_inplace(at::Tensor x, at::Tensor positions, at::Tensor cos,
                    at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary needs [T, heads, dim], dim contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous());
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous());
  TORCH_CHECK(cos.size(1) * 2 == x.size(2), "rotary table width must be head_dim / 2");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    rotary_typed<scalar_t>(x, positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                           sin.data_ptr<float>());
  });
}

at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul needs a contiguous [T, 2 * width] input");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul",
                                  [&] { silu_and_mul_typed<scalar_t>(out, x); });
  return out;
}

at::Tensor gelu_tanh_and_mul(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "gelu_tanh_and_mul needs a contiguous [T, 2 * width] input");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gelu_and_mul",
                                  [&] { gelu_tanh_and_mul_typed<scalar_t>(out, x); });
  return out;
}

namespace {

// What this build computes natively (a constant of the build: octavo/kernels/native.py reads it
// once at load, not per call).
std::vector<std::string> features() {
  std::vector<std::string> names;
  if (built_with_avx512_bf16()) names.insert(names.end(), {"int4_gemm_bf16", "prompt_runs"});
  if (built_with_avx2()) names.push_back("int4_gemm_f32");
  if (kInt4Int8Gemm) names.push_back("int4_int8_gemm");
  if (kInt4Int8Gemm || kInt4Int8GemmAvx2) names.push_back("int4_int8_gemm_f32");
  if (kInt4Int16Gemm) names.push_back("int4_int16_gemm");
  return names;
}

}  // namespace

// The schemas here, the CPU kernels below: other dispatch keys stay free for the output-shape
// functions octavo/kernels/native.py registers (torch.compile and FakeTensor tracing). The
// DecodeStack class joins the library from decode_stack.cpp (TORCH_LIBRARY_FRAGMENT).
TORCH_LIBRARY(octavo, m) {
  m.def("features() -> str[]", &features);  // no tensor to dispatch on: one kernel for all
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> ()");
  m.def("decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor token_index, Tensor block_table, Tensor seq_lens, float scale, float softcap, "
        "int window, Tensor(b!)? lse=None) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("one_plus_rms_norm(Tensor x, Tensor plus_one, float eps) -> Tensor");
  m.def("rotary_inplace(Tensor(a!) x, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor x) -> Tensor");
  m.def("int8_gemv(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("int4_gemm(Tensor x, Tensor codes, Tensor scales, Tensor? high_bits=None) -> Tensor");
  m.def("int4_int8_gemm(Tensor x, Tensor codes, Tensor scales, Tensor? high_bits=None) "
        "-> Tensor");
  m.def("int4_int16_gemm(Tensor x, Tensor codes, Tensor scales, Tensor? high_bits=None) "
        "-> Tensor");
  m.def("int4_dequantize(Tensor codes, Tensor scales, Tensor? high_bits, int first_block, "
        "int blocks, bool bf16) "
        "-> Tensor");
  m.def("int4_tiled_linear(Tensor x, Tensor codes, Tensor scales, Tensor? high_bits=None) "
        "-> Tensor");
  m.def("int4_rows(Tensor codes, Tensor scales, Tensor? high_bits, Tensor ids, bool bf16) "
        "-> Tensor");
  m.def("int8_dequantize(Tensor q, Tensor scale, int first, int count, bool bf16) -> Tensor");
  m.def("int8_tiled_linear(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("lora_apply(Tensor(a!) y, Tensor x, Tensor a, Tensor b, int[] bounds, Tensor used, "
        "Tensor token_slot) -> ()");
  m.def("microscaled_gemv(Tensor x, Tensor codes, Tensor scales, Tensor code_lut, "
        "Tensor scale_lut, int block) -> Tensor");
  m.def("microscaled_dequantize(Tensor codes, Tensor scales, Tensor code_lut, Tensor scale_lut, "
        "int block, int first, int count) -> Tensor");
  m.def("microscaled_tiled_linear(Tensor x, Tensor codes, Tensor scales, Tensor code_lut, "
        "Tensor scale_lut, int block) -> Tensor");
  m.def("delta_rule_step(Tensor(a!) state, Tensor rows, Tensor q, Tensor k, Tensor v, "
        "Tensor beta, Tensor g) -> Tensor");
}

TORCH_LIBRARY_IMPL(octavo, CPU, m) {
  m.impl("write_kv", &write_kv);
  m.impl("decode_attention", &decode_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("one_plus_rms_norm", &one_plus_rms_norm);
  m.impl("rotary_inplace", &rotary_inplace);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("int8_gemv", &int8_gemv);
  m.impl("int4_gemm", &int4_gemm);
  m.impl("int4_int8_gemm", &int4_int8_gemm);
  m.impl("int4_int16_gemm", &int4_int16_gemm);
  m.impl("int4_dequantize", &int4_dequantize);
  m.impl("int4_tiled_linear", &int4_tiled_linear);
  m.impl("int4_rows", &int4_rows);
  m.impl("int8_dequantize", &int8_dequantize);
  m.impl("int8_tiled_linear", &int8_tiled_linear);
  m.impl("microscaled_gemv", &microscaled_gemv);
  m.impl("microscaled_dequantize", &microscaled_dequantize);
  m.impl("microscaled_tiled_linear", &microscaled_tiled_linear);
  m.impl("delta_rule_step", &delta_rule_step);
  m.impl("lora_apply", [](at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor b,
                          std::vector<int64_t> bounds, at::Tensor used, at::Tensor token_slot) {
    lora_apply(y, x, a, b, bounds, used, token_slot);
  });
}
