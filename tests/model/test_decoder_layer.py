"""Each family writes its decoder layer once: modules plus their description (LayerSpec). The
Python layers run that description (model/decoder_layer.py) and the fused decode stack runs it
too, so no family keeps a forward of its own beside it (the stack's agreement with the Python
layers is tests/kernels/test_decode_stack.py; both against transformers, tests/parity)."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from octavo.model import registry
from octavo.model.decoder_layer import DecoderLayer
from octavo.model.models import cohere, gemma, glm, gpt2, gpt_neox, granite, llama, moe, olmo2
from octavo.model.models import deepseek, gpt_oss, llama4, qwen3_next, starcoder2

FAMILIES = (llama, gemma, gpt2, gpt_neox, moe, granite, olmo2, starcoder2, cohere, glm, gpt_oss,
            deepseek, llama4, qwen3_next)


def test_no_family_writes_a_layer_forward_beside_its_description():
    layers = [obj for mod in FAMILIES for obj in vars(mod).values()
              if isinstance(obj, type) and issubclass(obj, DecoderLayer)
              and obj is not DecoderLayer]
    assert {c.__name__ for c in layers} >= {
        "LlamaDecoderLayer", "GemmaDecoderLayer", "GPT2Block", "NeoXLayer", "MoeDecoderLayer",
        "Olmo2DecoderLayer", "Starcoder2DecoderLayer", "CohereDecoderLayer", "GlmDecoderLayer",
        "GptOssDecoderLayer", "DeepseekDecoderLayer", "Llama4DecoderLayer",
        "Qwen3NextDecoderLayer"}
    for cls in layers:
        assert cls.forward is DecoderLayer.forward, cls.__name__
    for mod in FAMILIES:  # only the models (ids -> hidden states) run modules themselves
        for name, obj in vars(mod).items():
            if (isinstance(obj, type) and issubclass(obj, nn.Module)
                    and obj.__module__ == mod.__name__ and "forward" in vars(obj)):
                assert "input_ids" in inspect.signature(obj.forward).parameters, name


def test_every_registered_architecture_builds_described_layers():
    """The registry's decoders all come from these families (a new one must describe its
    layers, or this fails); an encoder (BERT) has no decode path to describe its layers for:
    its file writes each layer once, and nothing else runs it."""
    families = {mod.__name__ for mod in FAMILIES}
    for arch in registry.supported_architectures():
        cls = registry.model_class(arch)
        assert cls.is_encoder or cls.__module__ in families, arch


def test_a_layer_describes_itself_once_and_runs_it(monkeypatch):
    import octavo.model.decoder_layer as decoder_layer

    class Described(DecoderLayer):
        calls = 0

        def spec(self):
            Described.calls += 1
            return f"spec {Described.calls}"

    ran = []
    monkeypatch.setattr(decoder_layer, "run_layer",
                        lambda spec, positions, x: ran.append(spec) or x + 1)
    layer, x = Described(), torch.zeros(2, 4)
    assert torch.equal(layer(torch.arange(2), layer(torch.arange(2), x)), x + 2)
    assert ran == ["spec 1", "spec 1"]  # described on first use, then kept
    with pytest.raises(NotImplementedError, match="does not describe its layer"):
        DecoderLayer().spec()
