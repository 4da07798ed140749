"""Model resolution: catalog fetch with sha256, local paths, hub ids failing fast offline."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import time

import pytest

from octavo.model_source import CATALOG, resolve_model


def test_catalog_fetch_verifies_and_refetches_corrupt_files(tmp_path, monkeypatch):
    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "octavo.entrypoints.cli.main", "pull",
                           "smollm2-135m-instruct"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    path = tmp_path / "models" / CATALOG["smollm2-135m-instruct"].file
    assert done.stdout.strip() == str(path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == CATALOG["smollm2-135m-instruct"].sha256
    # Same size, wrong bytes: detected by the hash and fetched again.
    data = bytearray(path.read_bytes())
    data[1000] ^= 0xFF
    path.write_bytes(bytes(data))
    source = resolve_model("smollm2-135m-instruct")
    assert hashlib.sha256(source.path.read_bytes()).hexdigest() == \
        CATALOG["smollm2-135m-instruct"].sha256


def test_hub_id_fails_fast_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    start = time.perf_counter()
    with pytest.raises(ValueError, match="cannot fetch 'nobody/no-such-model'"):
        resolve_model("nobody/no-such-model")
    assert time.perf_counter() - start < 30


@pytest.mark.parametrize("arg, message", [
    ("/nonexistent/model.gguf", "does not exist"),
    ("./not/a/model", "neither a catalog name"),
    ("no-such-catalog-name", "neither a catalog name"),
])
def test_bad_model_arguments(arg, message):
    with pytest.raises(ValueError, match=message):
        resolve_model(arg)


def test_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_generation_config_sampling_settings_become_request_defaults(tmp_path):
    import json

    import pytest

    from octavo.arch_config import read_arch_config
    from octavo.model_source import ModelSource
    from octavo.params import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "num_attention_heads": 2, "num_hidden_layers": 1}))
    gen = {"eos_token_id": [2, 5], "temperature": 0.6, "top_p": 0.9, "top_k": 20,
           "do_sample": True, "max_length": 99}
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    arch = read_arch_config(ModelSource("x", tmp_path))
    assert arch.eos_token_ids == (2, 5)
    assert arch.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    params = SamplingParams(**arch.sampling_defaults)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.6, 0.9, 20, 0.0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ValueError, match="generation_config.json: top_p must be"):
        read_arch_config(ModelSource("x", tmp_path))


def test_an_omitted_tie_word_embeddings_takes_the_architectures_default(tmp_path):
    """config.json saved with its defaults left out omits tie_word_embeddings: Cohere's and
    StarCoder 2's transformers configs tie by default, Llama's does not."""
    import json

    from octavo.arch_config import read_arch_config
    from octavo.model_source import ModelSource

    def tied(arch: str, **extra) -> bool:
        (tmp_path / "config.json").write_text(json.dumps({
            "architectures": [arch], "vocab_size": 64, "hidden_size": 32,
            "num_attention_heads": 2, "num_hidden_layers": 1, **extra}))
        return read_arch_config(ModelSource("x", tmp_path)).tie_word_embeddings

    assert tied("CohereForCausalLM") and tied("Starcoder2ForCausalLM")
    assert not tied("LlamaForCausalLM") and not tied("CohereForCausalLM",
                                                      tie_word_embeddings=False)
