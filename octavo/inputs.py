"""vLLM's prompt forms for the offline API: a string, a list of token ids, a `TextPrompt` or a
`TokensPrompt` (`from octavo.inputs import TextPrompt, TokensPrompt`, as from vllm.inputs)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[Any]  # refused: octavo serves text-only models so far
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[Any]
    cache_salt: NotRequired[str]


PromptType = str | Sequence[int] | TextPrompt | TokensPrompt

_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data", "cache_salt"}


def unwrap_prompt(prompt: Any) -> tuple[Any, str | None]:
    """(the text or token ids, the prompt's own cache_salt) of any prompt form; ValueError for
    a malformed dict, NotImplementedError for multimodal data."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = sorted(set(prompt) - _KEYS)
    if unknown:
        raise ValueError(f"unknown prompt field(s) {', '.join(map(repr, unknown))}; a prompt "
                         f"dict has 'prompt' or 'prompt_token_ids', and optionally "
                         f"'cache_salt'")
    if prompt.get("multi_modal_data") is not None:
        raise NotImplementedError("multi_modal_data: octavo runs text-only models so far")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict needs exactly one of 'prompt' (TextPrompt) and "
                         "'prompt_token_ids' (TokensPrompt)")
    body = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
    if "prompt" in prompt and not isinstance(body, str):
        raise ValueError(f"TextPrompt 'prompt' must be a string, got {type(body).__name__}")
    return body, prompt.get("cache_salt")


def is_single_prompt(prompts: Any) -> bool:
    """Whether `prompts` is one prompt rather than a list of them."""
    return (isinstance(prompts, (str, dict))
            or (isinstance(prompts, Sequence) and bool(prompts)
                and not isinstance(prompts[0], (str, dict, list, tuple))))
