// Fused CPU kernels for the decode hot path. Each one replaces a chain of small ATen calls whose
// dispatch cost, not arithmetic, dominates a decode step of a small model. Every kernel has a
// pure-PyTorch twin in octavo/kernels/fused.py that the tests compare it with.
// The kernels live in the headers beside this file; here are the PyTorch bindings and
// DecodeStack (decode_stack.h), the decoder layers of a decode step in one call.
#include "dequant.h"
#include "layer_ops.h"
#include "paged_attention.h"
#include "quant_gemv.h"

namespace {

void check_cache(const torch::Tensor& kc, const torch::Tensor& vc) {
  TORCH_CHECK(kc.dim() == 4 && kc.is_contiguous() && vc.is_contiguous(),
              "cache must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(kc.scalar_type() == vc.scalar_type(), "K and V caches differ in dtype");
}

}  // namespace

void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t n = slot_mapping.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "write_kv_c",
                                  [&] { write_kv_typed<scalar_t>(k, v, k_cache, v_cache, slots, n); });
}

void decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor token_index, torch::Tensor block_table,
                      torch::Tensor seq_lens, double scale, double softcap, int64_t window) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "out and q differ in dtype");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(1) / k_cache.size(2) <= kMaxGroup, "too many query heads per KV head");
  TORCH_CHECK(token_index.is_contiguous() && seq_lens.is_contiguous() &&
              block_table.stride(1) == 1, "index tensors must be contiguous");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_q", [&] {
    using q_t = scalar_t;
    if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {  // fp8 cache: the caller folds in scales
      decode_attention_typed<q_t, c10::Float8_e4m3fn>(out, q, k_cache, v_cache, token_index,
                                                      block_table, seq_lens, scale, softcap,
                                                      window);
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "decode_c",
                                    [&] {
      decode_attention_typed<q_t, scalar_t>(out, q, k_cache, v_cache, token_index, block_table,
                                            seq_lens, scale, softcap, window);
    });
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm needs contiguous inputs");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm weight dtype differs");
  auto flat = x.view({-1, x.size(-1)});
  auto out = torch::empty_like(flat);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_typed<scalar_t>(out, flat, weight, eps);
  });
  return out.view(x.sizes());
}

void rotary_inplace(torch::Tensor x, torch::Tensor positions, torch::Tensor cos,
                    torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary needs [T, heads, dim], dim contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous());
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous());
  TORCH_CHECK(cos.size(1) * 2 == x.size(2), "rotary table width must be head_dim / 2");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    rotary_typed<scalar_t>(x, positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                           sin.data_ptr<float>());
  });
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "silu_and_mul needs a contiguous [T, 2 * width] input");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul",
                                  [&] { silu_and_mul_typed<scalar_t>(out, x); });
  return out;
}

torch::Tensor gelu_tanh_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "gelu_tanh_and_mul needs a contiguous [T, 2 * width] input");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gelu_and_mul",
                                  [&] { gelu_tanh_and_mul_typed<scalar_t>(out, x); });
  return out;
}

torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor q, torch::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && q.is_contiguous() && scale.is_contiguous());
  TORCH_CHECK(q.scalar_type() == at::kChar &&
              (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf),
              "int8_gemv: int8 codes with float32 or float16 scales");
  TORCH_CHECK(x.size(1) == q.size(1), "int8_gemv: inner sizes differ");
  TORCH_CHECK(scale.size(0) == q.size(0) && (scale.dim() == 1 ||
              (scale.dim() == 2 && q.size(1) % scale.size(1) == 0 &&
               (q.size(1) / scale.size(1)) % 16 == 0)),
              "int8_gemv: scale must be [N] or [N, G] with groups of a multiple of 16 inputs");
  const int64_t rows = x.size(0), n = q.size(0), k = q.size(1);
  const int64_t groups = scale.dim() == 2 ? scale.size(1) : 0;
  auto out = torch::empty({rows, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "int8_gemv", [&] {
    std::vector<float> xf;
    widen_rows<scalar_t>(x, xf);
    scalar_t* op = out.data_ptr<scalar_t>();
    // Each thread takes a block of 64 weight rows (tens of KB: they stay in L2) and runs every
    // chunk of up to 8 activation rows over it, so the weights come from memory once.
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t c = 0; c < rows; c += 8) {
        for_rows(std::min<int64_t>(8, rows - c), [&](auto r) {
          if (scale.scalar_type() == at::kHalf)
            int8_rows_block<scalar_t, decltype(r)::value>(
                op + c * n, n, xf.data() + c * k, k, q.data_ptr<int8_t>(),
                scale.data_ptr<at::Half>(), groups, begin, end);
          else
            int8_rows_block<scalar_t, decltype(r)::value>(
                op + c * n, n, xf.data() + c * k, k, q.data_ptr<int8_t>(),
                scale.data_ptr<float>(), groups, begin, end);
        });
      }
    });
  });
  return out;
}

bool built_with_avx512_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

bool built_with_avx2() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

// x [M, K] float32 times int4 weights in octavo's layout -> [M, N] float32 (int4_block_f32).
torch::Tensor int4_gemm_f32(const torch::Tensor& x, const torch::Tensor& q4, const torch::Tensor& sz,
                            bool half_scales) {
  TORCH_CHECK(built_with_avx2(), "int4_gemm with float32 activations needs AVX2 and FMA");
  const int64_t rows = x.size(0), k = x.size(1), blocks = q4.size(0), n = blocks * 16;
  auto out = torch::empty({rows, n}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t groups = k / 32;
  const float* xp = x.data_ptr<float>();
  // Each row's inputs in the kernel's order (4c, 4c + 2, 4c + 1, 4c + 3), scaled by 16^-i, and
  // its sum over each group of 32.
  std::vector<float> xs(rows * k), xsum(rows * groups);
  constexpr int kOrder[4] = {0, 2, 1, 3};
  constexpr float kScale[4] = {1.f, 1.f / 16, 1.f / 256, 1.f / 4096};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < k; c += 4)
      for (int i = 0; i < 4; ++i) xs[r * k + c + i] = xp[r * k + c + kOrder[i]] * kScale[i];
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < 32; ++i) s += xp[r * k + g * 32 + i];
      xsum[r * groups + g] = s;
    }
  }
  const uint8_t* qp = q4.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  auto run = [&](const auto* sp) {
    // A row block (k / 2 bytes) stays in L1 for every chunk of 4 rows of x.
    at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b)
        for (int64_t c = 0; c < rows; c += 4) {
          const int64_t m = std::min<int64_t>(4, rows - c);
          for_rows(m, [&](auto r) {
            if constexpr (decltype(r)::value <= 4)
              int4_block_f32<decltype(r)::value>(qp + b * k * 8, sp + b * groups * 32,
                                                 xs.data() + c * k, k, xsum.data() + c * groups,
                                                 op + c * n + b * 16, n);
          });
        }
    });
  };
  if (half_scales)
    run(sz.data_ptr<at::Half>());
  else
    run(sz.data_ptr<float>());
#endif
  return out;
}

// x [M, K] bf16 or float32 times int4 weights in octavo's layout (see int4_block) -> [M, N] in
// x's dtype, with N the padded row count (a multiple of 16).
torch::Tensor int4_gemm(torch::Tensor x, torch::Tensor q4, torch::Tensor sz) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
              (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "int4_gemm: x must be a contiguous [M, K] bf16 or float32 tensor");
  TORCH_CHECK(q4.dim() == 3 && q4.size(2) == 32 && q4.scalar_type() == at::kByte &&
              q4.is_contiguous(), "int4_gemm: codes must be [N / 16, K / 4, 32] uint8");
  const int64_t rows = x.size(0), k = x.size(1), blocks = q4.size(0), n = blocks * 16;
  TORCH_CHECK(k % 32 == 0 && q4.size(1) * 4 == k, "int4_gemm: K must match, a multiple of 32");
  const bool half_scales = sz.scalar_type() == at::kHalf;
  TORCH_CHECK((half_scales || sz.scalar_type() == at::kFloat) && sz.is_contiguous() &&
              sz.numel() == blocks * (k / 32) * 32,
              "int4_gemm: scales must be [N/16, K/32, 2, 16] float32 or float16");
  if (x.scalar_type() == at::kFloat) return int4_gemm_f32(x, q4, sz, half_scales);
  TORCH_CHECK(built_with_avx512_bf16(), "int4_gemm with bf16 activations needs AVX-512-BF16");
  auto out = torch::empty({rows, n}, x.options());
#if defined(__AVX512BF16__)
  const int64_t groups = k / 32;
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  std::vector<float> xsum(rows * groups);  // each row's sum over each group of 32 inputs
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = 0; i < 32; ++i) s += static_cast<float>(xp[r * k + g * 32 + i]);
      xsum[r * groups + g] = s;
    }
  const uint8_t* qp = q4.data_ptr<uint8_t>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  auto run = [&](const auto* sp) {
    // A row block is k / 2 bytes (a few KB): it stays in L1 for every chunk of 8 rows of x.
    at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
      __m512 acc[8];
      for (int64_t b = begin; b < end; ++b) {
        for (int64_t c = 0; c < rows; c += 8) {
          const int64_t m = std::min<int64_t>(8, rows - c);
          for_rows(m, [&](auto r) {
            int4_block<decltype(r)::value>(qp + b * k * 8, sp + b * groups * 32, xp + c * k, k,
                                           xsum.data() + c * groups, acc);
          });
          for (int64_t r = 0; r < m; ++r) store16(op + (c + r) * n + b * 16, acc[r]);
        }
      }
    });
  };
  if (half_scales)
    run(sz.data_ptr<at::Half>());
  else
    run(sz.data_ptr<float>());
#endif
  return out;
}

// A linear layer of DecodeStack (decode_stack.h): its dense weight and/or its low-bit one.
struct StackLinear {
  torch::Tensor dense;  // [N, K], the weight every batch size can use; undefined: packed only
  torch::Tensor bias;   // [N] or undefined
  int64_t kind = 0;     // packed weight: 0 none, 4 int4 (torch's layout), 5 int4 (octavo's
                        // layout, see int4_block), 8 int8
  torch::Tensor low_a;  // int4: packed codes (N padded to 16); int8: codes [N, K]
  torch::Tensor low_b;  // int4: scales and zeros (torch: [K / 32, N, 2]); int8: float scale per row
  int64_t out = 0;      // N
  int64_t max_rows = 0;  // with a dense weight: the most rows the packed one serves (decode)

  // Alone, the packed weight serves every batch the stack is given (DecodeStack.max_tokens
  // keeps those small).
  torch::Tensor operator()(const torch::Tensor& x) const {
    if (kind != 0 && (!dense.defined() || x.size(0) <= max_rows)) {
      auto y = kind == 5   ? int4_gemm(x, low_a, low_b)
               : kind == 4 ? at::_weight_int4pack_mm_for_cpu(x, low_a, 32, low_b)
                           : int8_gemv(x, low_a, low_b);
      if (y.size(1) != out) y = y.narrow(1, 0, out);
      return bias.defined() ? y + bias : y;
    }
    // The bias is added after the product, as the Python layer adds it (one rounding each).
    auto y = dense.is_mkldnn() ? packed_linear(x, dense) : at::linear(x, dense);
    return bias.defined() ? y + bias : y;
  }

  // A weight packed by octavo/kernels/onednn.py: oneDNN's linear op, as its Python side calls it.
  static torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& weight) {
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x, weight, c10::IValue(), std::string("none"),
                            c10::List<std::optional<at::Scalar>>(), c10::IValue()};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
};

#include "decode_stack.h"  // DecodeStack, over these StackLinears

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemv", &int8_gemv);
  m.def("int4_gemm", &int4_gemm);
  m.def("int4_dequantize", &int4_dequantize);
  m.def("int4_tiled_linear", &int4_tiled_linear);
  m.attr("has_int4_gemm") = built_with_avx512_bf16();  // a constant of the build: no call per use
  m.attr("has_int4_gemm_f32") = built_with_avx2();
  m.attr("has_prompt_runs") = built_with_avx512_bf16();
  m.def("write_kv", &write_kv);
  m.def("decode_attention", &decode_attention);
  m.def("rms_norm", &rms_norm);
  m.def("rotary_inplace", &rotary_inplace);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  py::class_<StackLinear>(m, "StackLinear")
      .def(py::init([](c10::optional<torch::Tensor> dense, c10::optional<torch::Tensor> bias,
                       int64_t kind, c10::optional<torch::Tensor> low_a,
                       c10::optional<torch::Tensor> low_b, int64_t out, int64_t max_rows) {
        TORCH_CHECK(kind == 0 || kind == 4 || kind == 5 || kind == 8, "kind must be 0, 4, 5 or 8");
        TORCH_CHECK(kind == 0 || (low_a && low_b), "a low-bit kind needs its tensors");
        TORCH_CHECK(dense || kind != 0, "a linear needs a dense or a packed weight");
        StackLinear lin;
        if (dense) lin.dense = *dense;
        lin.out = out;
        if (bias) lin.bias = *bias;
        lin.kind = kind;
        if (low_a) lin.low_a = *low_a;
        if (low_b) lin.low_b = *low_b;
        lin.max_rows = max_rows;
        return lin;
      }));
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t, double>(), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("eps"))
      .def("add_layer", &DecodeStack::add_layer, py::arg("norms"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("one_plus_norms"), py::arg("linears"), py::arg("kv_cache"),
           py::arg("cos"), py::arg("sin"), py::arg("scale"), py::arg("softcap"), py::arg("plan"),
           py::arg("activation"))
      .def("set_all_reduce", &DecodeStack::set_all_reduce)
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>());
}
