"""Adapters that cannot be served are refused before their request is queued, with a message
naming the adapter, and the engine goes on serving everyone else."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from octavo import LLM, LoRARequest, SamplingParams
from tests.parity.test_tiny_models import _build

pytest.importorskip("peft")

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm_oracle_folder):
    from tests.parity.test_lora import ALL, make_adapter

    tmp = tmp_path_factory.mktemp("lora-refusals")
    folder, base = _build(tmp, smollm_oracle_folder, "llama-default")
    good = tmp / "good"
    make_adapter(base, 8, ALL, False, 0, good)
    make_adapter(base, 16, ["q_proj"], False, 0, tmp / "rank16")
    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=8 << 20,
              enable_lora=True, max_loras=2, max_lora_rank=8)
    return llm, tmp, good, base


def _variant(tmp, good, name, edit=None):
    path = tmp / name
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(good, path)
    if edit is not None:
        edit(path)
    return path


def _set_config(**changes):
    def edit(path):
        config = json.loads((path / "adapter_config.json").read_text())
        config.update(changes)
        (path / "adapter_config.json").write_text(json.dumps(config))
    return edit


def _rewrite_tensors(change):
    def edit(path):
        from safetensors.torch import load_file, save_file

        tensors = load_file(path / "adapter_model.safetensors")
        save_file(change(tensors), path / "adapter_model.safetensors")
    return edit


def _rename_module(tensors):
    return {k.replace("mlp.up_proj", "mlp.fc_in"): v for k, v in tensors.items()}


def _other_shape(tensors):
    key = next(k for k in tensors if "q_proj.lora_B" in k)
    return {**tensors, key: torch.zeros(tensors[key].shape[0] * 2, tensors[key].shape[1])}


def _truncate(path):
    data = (path / "adapter_model.safetensors").read_bytes()
    (path / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])


def _pickle_only(path):
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")


def _rank16(path):
    shutil.rmtree(path)
    shutil.copytree(path.parent / "rank16", path)


CASES = {
    "rank": (_rank16, "has rank 16, above --max-lora-rank 8"),
    "dora": (_set_config(use_dora=True), "DoRA"),
    "module": (_rewrite_tensors(_rename_module), "no module model.layers.0.mlp.fc_in"),
    "shape": (_rewrite_tensors(_other_shape), "is for a layer of"),
    "missing": (lambda p: shutil.rmtree(p), "no such directory"),
    "no-config": (lambda p: (p / "adapter_config.json").unlink(),
                  "adapter_config.json is missing"),
    "corrupt": (_truncate, "corrupt"),
    "pickle": (_pickle_only, "a pickle, which octavo never loads"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_adapter_is_refused_by_name(setup, case):
    llm, tmp, good, _ = setup
    edit, message = CASES[case]
    path = _variant(tmp, good, f"bad-{case}", edit)
    with pytest.raises(ValueError, match=message) as info:
        llm.generate(["hello"], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest(f"bad-{case}", 100, str(path)))
    assert f"'bad-{case}'" in str(info.value)
    assert not llm.engine.has_unfinished_requests()
    # the engine serves base and adapter requests as before
    outs = llm.generate(["hello", "hello"], GREEDY, use_tqdm=False,
                        lora_request=[None, LoRARequest("good", 1, str(good))])
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)


def test_an_id_keeps_naming_one_adapter(setup):
    llm, tmp, good, _ = setup
    other = _variant(tmp, good, "other")
    llm.generate(["hi"], GREEDY, use_tqdm=False, lora_request=LoRARequest("good", 1, str(good)))
    with pytest.raises(ValueError, match="already names adapter 'good'"):
        llm.generate(["hi"], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("other", 1, str(other)))


def test_adapters_need_enable_lora(setup):
    llm, tmp, good, _ = setup
    plain = LLM(str(tmp / "llama-default"), dtype="float32", max_model_len=64,
                kv_cache_memory=4 << 20)
    with pytest.raises(ValueError, match="without LoRA"):
        plain.generate(["hi"], GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("good", 1, str(good)))
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, str(good))
    with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False,
                     lora_request=[LoRARequest("good", 1, str(good))])
