"""Architecture name -> model class, imported lazily."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # listing architectures (octavo models) needs no torch
    from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("octavo.model.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("octavo.model.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("octavo.model.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("octavo.model.models.llama", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("octavo.model.models.llama", "LlamaForCausalLM"),
    "GPTNeoXForCausalLM": ("octavo.model.models.gpt_neox", "GPTNeoXForCausalLM"),
    "GPT2LMHeadModel": ("octavo.model.models.gpt2", "GPT2LMHeadModel"),
    "MixtralForCausalLM": ("octavo.model.models.moe", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("octavo.model.models.moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("octavo.model.models.moe", "Qwen3MoeForCausalLM"),
    "Gemma2ForCausalLM": ("octavo.model.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("octavo.model.models.gemma", "Gemma3ForCausalLM"),
    "BertModel": ("octavo.model.models.bert", "BertModel"),
    "BertForSequenceClassification": ("octavo.model.models.bert",
                                      "BertForSequenceClassification"),
    "LlamaForSequenceClassification": ("octavo.model.models.llama",
                                       "LlamaForSequenceClassification"),
    "MistralForSequenceClassification": ("octavo.model.models.llama",
                                         "LlamaForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("octavo.model.models.llama",
                                       "LlamaForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("octavo.model.models.llama",
                                       "Qwen3ForSequenceClassification"),
    "ModernBertModel": ("octavo.model.models.modernbert", "ModernBertModel"),
    "ModernBertForSequenceClassification": ("octavo.model.models.modernbert",
                                            "ModernBertForSequenceClassification"),
    "RobertaModel": ("octavo.model.models.bert", "RobertaModel"),
    "XLMRobertaModel": ("octavo.model.models.bert", "RobertaModel"),
    "RobertaForSequenceClassification": ("octavo.model.models.bert",
                                         "RobertaForSequenceClassification"),
    "XLMRobertaForSequenceClassification": ("octavo.model.models.bert",
                                            "RobertaForSequenceClassification"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise NotImplementedError(
            f"architecture {architecture!r} is not supported yet; supported: "
            f"{', '.join(supported_architectures())}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
