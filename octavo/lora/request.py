"""vLLM's module name for the adapter request (`from octavo.lora.request import LoRARequest`, as
from vllm.lora.request)."""
from octavo.params import LoRARequest

__all__ = ["LoRARequest"]
