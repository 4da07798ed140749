"""Render a conversation through a chat template into prompt token ids."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def render_chat(tokenizer, messages: Sequence[dict[str, Any]], template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of `messages` rendered by `template` (default: the model's own).

    Message content may be a string or a list of text parts; other part types raise ValueError.
    """
    template = template or tokenizer.chat_template
    if template is None:
        raise ValueError("chat_template: this model has no chat template; pass one")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    conversation = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be an object with a 'role'")
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"messages[{i}].content[{j}]: content of type {kind!r} is "
                                     "not supported; only 'text'")
                texts.append(str(part.get("text", "")))
            m["content"] = "".join(texts)
        elif content is None:
            m["content"] = ""
        conversation.append(m)
    try:
        ids = tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=True,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **(template_kwargs or {}))
    except ValueError:
        raise
    except Exception as exc:  # a template error is the request's fault (bad roles, kwargs)
        raise ValueError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
