"""Make a draft model for speculative decoding by keeping the first N layers of a model.

No smaller model with SmolLM2's tokenizer ships here, so the honest draft is a layer-truncated
copy of the target: its first N transformer layers, its final norm and its LM head (and, for a
GGUF, its tokenizer and quantization unchanged). It shares the target's tokenizer by
construction. Usage:

    python tools/make_draft_model.py smollm2-135m-instruct /tmp/smollm2-draft-6.gguf --layers 6
    python tools/make_draft_model.py path/to/hf-folder path/to/draft-folder --layers 2

then `--speculative-config '{"method": "draft_model", "model": "/tmp/smollm2-draft-6.gguf",
"num_speculative_tokens": 4}'`. The source is a catalog name, a .gguf file or a Hugging Face
folder (config.json + safetensors); a GGUF source gives a .gguf, a folder a folder.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.")
_HF_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def truncate(source: str | Path, out: str | Path, num_layers: int) -> Path:
    """Write the first `num_layers` layers of `source` to `out`; returns `out`."""
    if num_layers < 1:
        raise ValueError(f"--layers must be >= 1, got {num_layers}")
    from octavo.model_source import resolve_model

    src = resolve_model(str(source))
    out = Path(out)
    if src.is_gguf:
        if out.suffix != ".gguf":
            raise ValueError(f"output: a GGUF source makes a .gguf file, got {out}")
        _truncate_gguf(src.path, out, num_layers)
    else:
        _truncate_folder(src.path, out, num_layers)
    return out


def _truncate_gguf(path: Path, out: Path, num_layers: int) -> None:
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    count_key = f"{arch}.block_count"
    total = reader.fields[count_key].contents()
    if num_layers > total:
        raise ValueError(f"--layers {num_layers} is more than the model's {total}")
    writer = gguf.GGUFWriter(out, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value = num_layers if field.name == count_key else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    kept = [t for t in reader.tensors
            if not (m := _GGUF_LAYER.match(t.name)) or int(m.group(1)) < num_layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()


def _truncate_folder(path: Path, out: Path, num_layers: int) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((path / "config.json").read_text())
    key = "num_hidden_layers" if "num_hidden_layers" in config else "n_layer"
    if num_layers > config[key]:
        raise ValueError(f"--layers {num_layers} is more than the model's {config[key]}")
    config[key] = num_layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:num_layers]
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                m = _HF_LAYER.search(name)
                if m is None or int(m.group(1)) < num_layers:
                    tensors[name] = f.get_tensor(name)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in path.iterdir():
        if extra.is_file() and (extra.name.startswith(("tokenizer", "special_tokens",
                                                       "generation_config", "chat_template"))
                                or extra.suffix in (".model", ".jinja")):
            shutil.copy(extra, out / extra.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="catalog name, .gguf file or Hugging Face folder")
    parser.add_argument("output", help=".gguf file (GGUF source) or folder")
    parser.add_argument("--layers", type=int, required=True, help="layers to keep (the first)")
    args = parser.parse_args()
    print(truncate(args.source, args.output, args.layers))


if __name__ == "__main__":
    main()
