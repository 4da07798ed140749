"""The adapters a front end knows: each request's adapter is checked (octavo/lora/adapter.py)
the first time its id is seen, and an id keeps naming the same adapter; the server's named
adapters (--lora-modules, and those loaded at run time) are listed here too, so that the
OpenAI `model` field can select one."""
from __future__ import annotations

import threading

from octavo.arch_config import ArchConfig
from octavo.config import LoRAConfig
from octavo.lora.adapter import AdapterSpec, check_architecture, read_adapter
from octavo.params import LoRARequest


class AdapterRegistry:
    def __init__(self, arch: ArchConfig, config: LoRAConfig, model_impl: str = "auto") -> None:
        if config.enable_lora:
            check_architecture(arch, model_impl)
        self.arch = arch
        self.config = config
        self.checked: dict[int, AdapterSpec] = {}  # adapter id -> the adapter it names
        self.named: dict[str, LoRARequest] = {}  # the server's adapters, by name
        self._last_id = 0  # ids given to named adapters: never reused, so an adapter loaded
        # anew under an old name never meets the old one's cached blocks or host copy
        self._lock = threading.Lock()  # runtime loads are checked on the front end's pool

    def check(self, request: LoRARequest | None) -> LoRARequest | None:
        """`request`, checked: ValueError (naming the adapter) if it cannot be served."""
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got "
                             f"{type(request).__name__}")
        if not self.config.enable_lora:
            raise ValueError(f"lora_request {request.lora_name!r}: this engine runs without "
                             f"LoRA (start it with enable_lora=True, --enable-lora)")
        known = self.checked.get(request.lora_int_id)
        if known is not None:
            old = known.request
            if (old.lora_name, old.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_int_id {request.lora_int_id} already names adapter "
                                 f"{old.lora_name!r} at {old.lora_path}; give "
                                 f"{request.lora_name!r} another id")
            return request
        self.checked[request.lora_int_id] = read_adapter(request, self.arch,
                                                         self.config.max_lora_rank)
        return request

    def add_named(self, name: str, path: str) -> LoRARequest:
        """A server adapter `name` at `path`, checked, with the next free id."""
        with self._lock:
            if name in self.named:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
            lora_id = self._last_id = max([self._last_id, *self.checked]) + 1
            request = self.check(LoRARequest(name, lora_id, path))
            self.named[name] = request
            return request

    def remove_named(self, name: str) -> LoRARequest:
        with self._lock:
            request = self.named.pop(name, None)
            if request is None:
                raise KeyError(name)
            self.checked.pop(request.lora_int_id, None)
            return request
