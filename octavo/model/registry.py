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
    "InternLM3ForCausalLM": ("octavo.model.models.llama", "LlamaForCausalLM"),
    "GraniteForCausalLM": ("octavo.model.models.granite", "GraniteForCausalLM"),
    "Olmo2ForCausalLM": ("octavo.model.models.olmo2", "Olmo2ForCausalLM"),
    "Starcoder2ForCausalLM": ("octavo.model.models.starcoder2", "Starcoder2ForCausalLM"),
    "CohereForCausalLM": ("octavo.model.models.cohere", "CohereForCausalLM"),
    "GlmForCausalLM": ("octavo.model.models.glm", "GlmForCausalLM"),
    "Glm4ForCausalLM": ("octavo.model.models.glm", "Glm4ForCausalLM"),
    "GptOssForCausalLM": ("octavo.model.models.gpt_oss", "GptOssForCausalLM"),
    "DeepseekV2ForCausalLM": ("octavo.model.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("octavo.model.models.deepseek", "DeepseekV3ForCausalLM"),
    "Llama4ForCausalLM": ("octavo.model.models.llama4", "Llama4ForCausalLM"),
    "Llama4ForConditionalGeneration": ("octavo.model.models.llama4", "Llama4ForCausalLM"),
    "GPTNeoXForCausalLM": ("octavo.model.models.gpt_neox", "GPTNeoXForCausalLM"),
    "GPT2LMHeadModel": ("octavo.model.models.gpt2", "GPT2LMHeadModel"),
    "MixtralForCausalLM": ("octavo.model.models.moe", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("octavo.model.models.moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("octavo.model.models.moe", "Qwen3MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("octavo.model.models.qwen3_next", "Qwen3NextForCausalLM"),
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
    """The architectures octavo has native files for."""
    return sorted(_MODELS)


def causal_lm_architectures() -> set[str]:
    """transformers' causal-LM classes (its AutoModelForCausalLM names): what the transformers
    backend may run (imports transformers, and with it torch)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def backend_architectures() -> list[str]:
    """The causal LMs without a native file whose transformers code takes octavo's attention,
    so the transformers backend runs them (each class imported to ask: seconds)."""
    import transformers

    names = []
    for name in sorted(causal_lm_architectures() - set(_MODELS)):
        try:
            cls = getattr(transformers, name)
        except (ImportError, AttributeError):  # a class behind an extra not installed
            continue
        if getattr(cls, "_supports_attention_backend", False):
            names.append(name)
    return names


def model_class(architecture: str, impl: str = "auto") -> type[nn.Module]:
    """The class that runs `architecture`: with impl auto, octavo's native file where it has
    one, else the transformers backend (any decoder-only *ForCausalLM whose transformers code
    takes an external attention function); octavo or transformers: only that one."""
    if impl != "transformers" and architecture in _MODELS:
        module, name = _MODELS[architecture]
        return getattr(importlib.import_module(module), name)
    if impl == "octavo":
        raise NotImplementedError(
            f"architecture {architecture!r} has no native file in octavo; native: "
            f"{', '.join(supported_architectures())}; --model-impl auto (or transformers) runs "
            f"it through transformers' code")
    from octavo.model.models.transformers_backend import TransformersForCausalLM, backend_class

    backend_class(architecture)  # NotImplementedError naming why it cannot run
    return TransformersForCausalLM
