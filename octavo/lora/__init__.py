"""LoRA adapters: the request type (vLLM's module name, octavo.lora.request) and reading PEFT
adapters from disk (adapter.py), shared by the front end, which checks an adapter before its
request is queued, and the worker, which loads its tensors."""
