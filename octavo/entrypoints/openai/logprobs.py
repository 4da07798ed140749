"""Logprobs in each OpenAI API's own shape. `as_ids` (vLLM's return_tokens_as_token_ids) names
each token "token_id:N" instead of its text, for tokens whose text is not valid UTF-8 alone;
`k` of -1 (the whole vocabulary) or `listed` (logprob_token_ids) keeps every entry of a
position."""
from __future__ import annotations

from octavo.params import PositionLogprobs


def _token_text(pos: PositionLogprobs | None, token: int, tokenizer, as_ids: bool) -> str:
    if as_ids:
        return f"token_id:{token}"
    if pos is not None and token in pos and pos[token].decoded_token is not None:
        return pos[token].decoded_token
    return tokenizer.decode([token])


def _ranked(pos: PositionLogprobs, k: int, listed: bool) -> list:
    ranked = sorted(pos.items(), key=lambda kv: kv[1].rank)
    return ranked if listed or k < 0 else ranked[:k]


def completion_logprobs(positions: list[PositionLogprobs | None], token_ids: list[int],
                        k: int, tokenizer, text_offset: int = 0, as_ids: bool = False,
                        listed: bool = False) -> dict:
    """/v1/completions: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_offset
    for tok, pos in zip(token_ids, positions):
        text = _token_text(pos, tok, tokenizer, as_ids)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if pos is None:  # the first prompt token has no logprob
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(max(pos[tok].logprob, -9999.0))
        top = {_token_text(pos, t, tokenizer, as_ids): max(lp.logprob, -9999.0)
               for t, lp in _ranked(pos, k, listed)}
        top.setdefault(text, token_lps[-1])
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode())}


def chat_logprobs(positions: list[PositionLogprobs], token_ids: list[int], k: int,
                  as_ids: bool = False, listed: bool = False) -> list[dict]:
    """/v1/chat/completions: logprobs.content, one entry per output token."""
    def text(t: int, lp) -> str:
        return f"token_id:{t}" if as_ids else lp.decoded_token or ""

    content = []
    for tok, pos in zip(token_ids, positions):
        entry = _entry(text(tok, pos[tok]), pos[tok].logprob)
        entry["top_logprobs"] = [_entry(text(t, lp), lp.logprob)
                                 for t, lp in _ranked(pos, k, listed)]
        content.append(entry)
    return content


def prompt_logprobs_json(positions: list[PositionLogprobs | None] | None) -> list | None:
    """vLLM's prompt_logprobs field: per prompt token, {token id: {logprob, rank,
    decoded_token}} (None for the first), -inf as -9999.0."""
    if positions is None:
        return None
    return [None if pos is None else
            {str(t): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank,
                      "decoded_token": lp.decoded_token} for t, lp in pos.items()}
            for pos in positions]
