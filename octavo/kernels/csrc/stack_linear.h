// A linear layer of DecodeStack (decode_stack.h): its dense weight and/or its low-bit one.
// Included by decode_stack.cpp only; the GEMMs it calls are ops.h's.
#pragma once

#include <string>

// The low-bit weight a linear layer of the stack holds, by the name the Python side gives it
// (octavo/model/decode_stack.py, _linear).
enum class LowBitKind { kNone, kInt4, kInt4Int8, kInt4Int16, kInt4Torch, kInt8, kMicroscaled };

inline LowBitKind low_bit_kind(const std::string& name) {
  if (name == "none") return LowBitKind::kNone;
  if (name == "int4") return LowBitKind::kInt4;  // octavo's layout (int4_gemm.h)
  // The same, its large batches with int8-quantized activations (int4_int8_gemm.h).
  if (name == "int4_int8") return LowBitKind::kInt4Int8;
  // The same, small batches with int16-quantized float32 activations (int4_int16_avx2.h).
  if (name == "int4_int16") return LowBitKind::kInt4Int16;
  if (name == "int4_torch") return LowBitKind::kInt4Torch;  // torch's, groups of 32
  if (name == "int8") return LowBitKind::kInt8;  // a scale per row or per group
  if (name == "microscaled") return LowBitKind::kMicroscaled;  // MX, NVFP4, FP8 (microscaled.h)
  TORCH_CHECK(false, "unknown low-bit weight kind '", name,
              "' (none, int4, int4_int8, int4_int16, int4_torch, int8, microscaled)");
}

// The adapters of a step's tokens (octavo/model/layers/lora.py, LoRAStep): each token's slot
// (-1: none), and the slots in the step. Empty: no adapter in the step.
struct LoraStep {
  at::Tensor token_slot;
  std::vector<int64_t> slots;
};

struct StackLinear {
  at::Tensor dense;  // [N, K], the weight every batch size can use; undefined: packed only
  at::Tensor bias;   // [N] or undefined
  LowBitKind kind = LowBitKind::kNone;
  // int4: packed codes (N padded to 16); int8 and microscaled: codes [N, K * bits / 8]
  at::Tensor low_a;
  // int4: scales and zeros (torch: [K / 32, N, 2]); int8: scales [N] or [N, G]; microscaled:
  // scales [N, K / block], bytes or float32
  at::Tensor low_b;
  // int4: the high plane of 5- or 8-bit codes (int4_gemm.h); microscaled: the codes' table
  std::optional<at::Tensor> low_c;
  at::Tensor low_d;  // microscaled: the scale bytes' table (empty: float32 scales)
  int64_t block = 0;  // microscaled: inputs per scale
  int64_t out = 0;   // N
  // The most rows the low-bit kernel serves (its crossover on this CPU); above them the dense
  // weight, or with none, the low-bit weight dequantized tile by tile into the dense GEMM.
  int64_t max_rows = 0;
  // LoRA slots (LoRASlots: A [slots, packed * rank, K], B^T [slots, rank, N], scaled, each
  // packed projection's output columns; which slots hold an adapter that targets this layer),
  // shared with Python, which fills them in place; undefined without LoRA.
  at::Tensor lora_a, lora_b, lora_used;
  std::vector<int64_t> lora_bounds;

  StackLinear() = default;
  StackLinear(const std::optional<at::Tensor>& dense_weight,
              const std::optional<at::Tensor>& bias_, const std::string& low_bit,
              const std::optional<at::Tensor>& a, const std::optional<at::Tensor>& b,
              const std::optional<at::Tensor>& c, const std::optional<at::Tensor>& d,
              int64_t out_features, int64_t rows)
      : kind(low_bit_kind(low_bit)), low_c(c), out(out_features), max_rows(rows) {
    TORCH_CHECK(kind == LowBitKind::kNone || (a && b), "a low-bit weight needs its tensors");
    TORCH_CHECK(!c || kind == LowBitKind::kInt4 || kind == LowBitKind::kInt4Int8 ||
                    kind == LowBitKind::kInt4Int16 || kind == LowBitKind::kMicroscaled,
                "a third tensor is an int4 weight's high plane or a microscaled weight's table");
    TORCH_CHECK(kind != LowBitKind::kMicroscaled || (c && d),
                "a microscaled weight comes with its codes' and its scales' tables");
    TORCH_CHECK(!d || kind == LowBitKind::kMicroscaled, "only a microscaled weight has a fourth "
                "tensor");
    TORCH_CHECK(dense_weight || kind != LowBitKind::kNone,
                "a linear needs a dense or a packed weight");
    if (dense_weight) dense = *dense_weight;
    if (bias_) bias = *bias_;
    if (a) low_a = *a;
    if (b) low_b = *b;
    if (kind == LowBitKind::kMicroscaled) {
      low_d = *d;
      // The block follows from the shapes: codes of 4 bits (16 values) or 8, scales per block.
      const int64_t k = low_a.size(1) * (low_c->numel() == 16 ? 2 : 1);
      TORCH_CHECK(low_b.dim() == 2 && low_b.size(1) > 0 && k % low_b.size(1) == 0,
                  "microscaled scales must be [N, K / block]");
      block = k / low_b.size(1);
    }
  }

  // The product with the weight, without the bias, computed as the Python layer computes it
  // (octavo/model/quant/packed.py, PackedWeight.matmul). Packed weights without tiles here
  // (torch's int4 layout, int8 with a scale per row) are never given more than their rows
  // (DecodeStack.max_tokens).
  at::Tensor product(const at::Tensor& x) const {
    const bool kernel = x.size(0) <= max_rows;
    if (dense.defined() && (kind == LowBitKind::kNone || !kernel))
      return dense.is_mkldnn() ? packed_linear(x, dense) : at::linear(x, dense);
    at::Tensor y;
    if (kind == LowBitKind::kInt4Int16 && kernel)
      y = int4_int16_gemm(x, low_a, low_b, low_c);
    else if (kind == LowBitKind::kInt4 || (kind == LowBitKind::kInt4Int8 && kernel))
      y = kernel ? int4_gemm(x, low_a, low_b, low_c) : int4_tiled_linear(x, low_a, low_b, low_c);
    else if (kind == LowBitKind::kInt4Int8 || kind == LowBitKind::kInt4Int16)
      y = int4_int8_gemm(x, low_a, low_b, low_c);
    else if (kind == LowBitKind::kInt4Torch)
      y = at::_weight_int4pack_mm_for_cpu(x, low_a, 32, low_b);
    else if (kind == LowBitKind::kMicroscaled)
      y = kernel ? microscaled_gemv(x, low_a, low_b, *low_c, low_d, block)
                 : microscaled_tiled_linear(x, low_a, low_b, *low_c, low_d, block);
    else
      y = kernel ? int8_gemv(x, low_a, low_b) : int8_tiled_linear(x, low_a, low_b);
    return y.size(1) != out ? y.narrow(1, 0, out) : y;
  }

  // The bias is added after the product, as the Python layer adds it (one rounding each).
  at::Tensor add_bias(const at::Tensor& y) const { return bias.defined() ? y + bias : y; }

  at::Tensor operator()(const at::Tensor& x) const { return add_bias(product(x)); }

  // The product with each token's adapter delta added (LoRASlots.add_delta's ops), without
  // the bias.
  at::Tensor product(const at::Tensor& x, const LoraStep& lora) const {
    if (!lora_a.defined() || lora.slots.empty()) return product(x);
    // One adapter's delta runs on this thread (lora_apply): its slot is asked for first, to
    // arrive while the base product streams. Several run on every core, and more than a
    // core's cache holds: this thread fetching them all would only delay the product.
    if (lora.slots.size() == 1 && lora_used.data_ptr<bool>()[lora.slots[0]])
      lora_prefetch(lora_a, lora_b, lora.slots[0]);
    auto y = product(x);
    lora_apply(y, x, lora_a, lora_b, lora_bounds, lora_used, lora.token_slot);
    return y;
  }

  at::Tensor operator()(const at::Tensor& x, const LoraStep& lora) const {
    return add_bias(product(x, lora));
  }

  // A weight packed by octavo/kernels/onednn.py: oneDNN's linear op, as its Python side calls it.
  static at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight) {
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x, weight, c10::IValue(), std::string("none"),
                            c10::List<std::optional<at::Scalar>>(), c10::IValue()};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
};
