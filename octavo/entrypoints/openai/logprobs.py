"""Logprobs in each OpenAI API's own shape."""
from __future__ import annotations

from octavo.params import PositionLogprobs


def _token_text(pos: PositionLogprobs | None, token: int, tokenizer) -> str:
    if pos is not None and token in pos and pos[token].decoded_token is not None:
        return pos[token].decoded_token
    return tokenizer.decode([token])


def completion_logprobs(positions: list[PositionLogprobs | None], token_ids: list[int],
                        k: int, tokenizer, text_offset: int = 0) -> dict:
    """/v1/completions: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for tok, pos in zip(token_ids, positions):
        text = _token_text(pos, tok, tokenizer)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if pos is None:  # the first prompt token has no logprob
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(pos[tok].logprob)
        ranked = sorted(pos.items(), key=lambda kv: kv[1].rank)[:max(k, 0)]
        top = {lp.decoded_token or tokenizer.decode([t]): lp.logprob for t, lp in ranked}
        top.setdefault(text, pos[tok].logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode())}


def chat_logprobs(positions: list[PositionLogprobs], token_ids: list[int], k: int) -> list[dict]:
    """/v1/chat/completions: logprobs.content, one entry per output token."""
    content = []
    for tok, pos in zip(token_ids, positions):
        chosen = pos[tok]
        entry = _entry(chosen.decoded_token or "", chosen.logprob)
        ranked = sorted(pos.items(), key=lambda kv: kv[1].rank)[:k]
        entry["top_logprobs"] = [_entry(lp.decoded_token or "", lp.logprob) for _, lp in ranked]
        content.append(entry)
    return content
