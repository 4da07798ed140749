"""Make a random-weight mixture-of-experts checkpoint (a Hugging Face folder) to measure on: no
real mixture of experts ships here. Qwen3-MoE by default, at the sizes docs/distributed.md quotes
figures for (12 layers, hidden 512, 32 experts of width 256, top 4) unless given; or DeepSeek V2
(`--family deepseek-v2`: latent attention of V2-Lite's head sizes halved, two shared experts, a
dense first layer, routing within the best half of the expert groups) or Llama 4 (`--family
llama4`: chunks of 256 tokens, every fourth layer without RoPE, a shared expert beside the
routed ones) or Qwen3-Next (`--family qwen3-next`: three Gated DeltaNet layers to one gated
attention layer, a gated shared expert), which docs/performance.md quotes decode figures for.
The tokenizer is SmolLM2's, copied from the folder given (its vocabulary sets the model's).
Usage:

    python3 -m tools.make_random_moe /tmp/qwen3-moe-random --tokenizer path/to/smollm2-folder

then `octavo bench throughput --model /tmp/qwen3-moe-random -dp 2 --enable-expert-parallel`.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def make(out: Path, tokenizer: Path, layers: int, hidden: int, experts: int, width: int,
         top_k: int, family: str = "qwen3-moe") -> Path:
    import torch
    import transformers

    vocab = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                  num_hidden_layers=layers, num_experts_per_tok=top_k,
                  moe_intermediate_size=width, max_position_embeddings=4096,
                  tie_word_embeddings=False)
    if family == "deepseek-v2":
        config = transformers.DeepseekV2Config(
            **common, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=experts,
            n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=256, q_lora_rank=None,
            qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
            topk_method="group_limited_greedy", n_group=4, topk_group=2)
        model = transformers.DeepseekV2ForCausalLM(config)
    elif family == "llama4":
        config = transformers.Llama4TextConfig(
            **{**common, "intermediate_size": width}, num_attention_heads=16,
            num_key_value_heads=4, head_dim=hidden // 16, num_local_experts=experts,
            intermediate_size_mlp=4 * hidden, interleave_moe_layer_step=1,
            attention_chunk_size=256)
        model = transformers.Llama4ForCausalLM(config)
    elif family == "qwen3-next":  # Qwen3-Next-80B's head shapes, halved in count
        config = transformers.Qwen3NextConfig(
            **common, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
            num_experts=experts, shared_expert_intermediate_size=width,
            linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
            linear_value_head_dim=128, norm_topk_prob=True)
        model = transformers.Qwen3NextForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(
            **common, num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
            num_experts=experts, norm_topk_prob=True)
        model = transformers.Qwen3MoeForCausalLM(config)
    torch.manual_seed(0)
    model = model.eval()
    with torch.no_grad():  # scaled so that activations neither vanish nor blow up
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.04)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokenizer", type=Path, required=True,
                        help="a folder with SmolLM2's tokenizer.json and tokenizer_config.json")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--width", type=int, default=256, help="each expert's intermediate size")
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--family", choices=["qwen3-moe", "deepseek-v2", "llama4", "qwen3-next"],
                        default="qwen3-moe")
    args = parser.parse_args()
    print(make(args.out, args.tokenizer, args.layers, args.hidden, args.experts, args.width,
               args.top_k, args.family))


if __name__ == "__main__":
    main()
