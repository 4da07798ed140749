"""LoRA adapters on the server: those named at start-up (--lora-modules), and the admin routes
that load and unload adapters at run time (--allow-runtime-lora-updating, vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter), from directories under --lora-root only.

An adapter is checked before it is listed (octavo/lora/adapter.py): a bad one is refused with
a 400 naming it, and nothing reaches the engine. Unloading takes the name away from new
requests; requests already running keep their adapter to the end.
"""
from __future__ import annotations

import json
import os

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from octavo.entrypoints.http import APIError, state_of
from octavo.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from octavo.lora.registry import AdapterRegistry

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def parse_lora_module(text: str) -> tuple[str, str]:
    """--lora-modules entry: name=path, or JSON {"name": ..., "path": ...} (vLLM's forms)."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            return str(spec["name"]), str(spec["path"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"--lora-modules {text!r}: JSON needs \"name\" and \"path\"") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: give name=path")
    return name, path


def add_startup_adapters(registry: AdapterRegistry, modules: list[str],
                         served_names: list[str]) -> None:
    """Check and name each --lora-modules adapter; ValueError naming the first bad one."""
    for text in modules:
        name, path = parse_lora_module(text)
        if name in served_names:
            raise ValueError(f"--lora-modules {name!r} is also a served model name")
        registry.add_named(name, path)


def under_root(root: str, path: str) -> str:
    """`path` (relative to the root, or absolute) resolved, symlinks followed: ValueError
    unless it and the adapter's files all lie under `root`."""
    top = os.path.realpath(root)
    where = os.path.realpath(os.path.join(top, path))
    for p in (where, os.path.join(where, CONFIG_FILE), os.path.join(where, WEIGHTS_FILE)):
        real = os.path.realpath(p)
        if os.path.commonpath([top, real]) != top:
            raise ValueError(f"lora_path {path!r} is outside --lora-root")
    return where


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request):
    state = state_of(request)
    registry = state.engine.processor.adapters
    if not body.lora_name or body.lora_name in state.served_model_names:
        raise APIError(400, f"lora_name {body.lora_name!r} is empty or a served model name",
                       "lora_name")
    try:
        path = under_root(state.lora_root, body.lora_path)
        await state.engine.offload.run("checking the adapter", registry.add_named,
                                       body.lora_name, path)
    except ValueError as exc:
        raise APIError(400, str(exc), "lora_path") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request):
    registry = state_of(request).engine.processor.adapters
    lora = registry.named.get(body.lora_name)
    if lora is None or body.lora_int_id not in (None, lora.lora_int_id):
        raise APIError(404, f"no LoRA adapter named {body.lora_name!r} is loaded", "lora_name")
    registry.remove_named(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
