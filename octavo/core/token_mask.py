"""A request's token restrictions besides its grammar: vLLM's allowed_token_ids and bad_words.

Both reach the worker in the step's token bitmask (the grammar's, intersected with them), so
one mechanism masks every token the sampler must not draw. allowed_token_ids is one fixed row;
a bad word is a token sequence whose last token is masked wherever the output so far ends with
the tokens before it (a one-token word is always masked), as vLLM matches them: against the
generated tokens only, never the prompt.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def packed_row(token_ids: Sequence[int], words: int) -> np.ndarray:
    """The int32 [words] bitmask row with exactly these tokens' bits set."""
    bits = np.zeros(words * 32, np.uint8)
    bits[np.asarray(token_ids, np.int64)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def clear_bits(row: np.ndarray, token_ids: Sequence[int]) -> None:
    """In place: clear these tokens' bits of an int32 bitmask row (repeats allowed)."""
    ids = np.asarray(token_ids, np.int64)
    words = row.view(np.uint32)
    np.bitwise_and.at(words, ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))


class TokenMask:
    """One request's allowed_token_ids and bad words (token sequences), for its bitmask rows."""

    __slots__ = ("allowed", "allowed_set", "always_banned", "sequences", "longest")

    def __init__(self, allowed_token_ids: Sequence[int] | None,
                 bad_words: Sequence[Sequence[int]], words: int) -> None:
        self.allowed = None if not allowed_token_ids else packed_row(allowed_token_ids, words)
        self.allowed_set = frozenset(allowed_token_ids or ())
        self.always_banned = sorted({seq[-1] for seq in bad_words if len(seq) == 1})
        # (the tokens before the last, the last) of each longer word
        self.sequences = [(list(seq[:-1]), seq[-1]) for seq in bad_words if len(seq) > 1]
        self.longest = max((len(p) for p, _ in self.sequences), default=0)

    def banned(self, output: Sequence[int], extra: Sequence[int] = ()) -> list[int]:
        """The bad words' last tokens masked after `output` + `extra` (the drafts verified
        before this position)."""
        out = list(self.always_banned)
        if self.sequences:
            tail = list(output[len(output) - self.longest:] if self.longest < len(output)
                        else output) + list(extra)
            for prefix, last in self.sequences:
                if len(prefix) <= len(tail) and tail[len(tail) - len(prefix):] == prefix:
                    out.append(last)
        return out

    def apply(self, row: np.ndarray, output: Sequence[int], extra: Sequence[int] = ()) -> None:
        """In place on one int32 bitmask row: keep the allowed tokens, drop the banned ones."""
        if self.allowed is not None:
            row &= self.allowed
        banned = self.banned(output, extra)
        if banned:
            clear_bits(row, banned)

    def refusal(self, token: int, output: Sequence[int]) -> str | None:
        """Why `token`, sampled after `output`, breaks the mask (None: it does not). The
        bitmask never allows such a token, so one comes only from a row that allowed none."""
        if self.allowed is not None and token not in self.allowed_set:
            reason = "is outside allowed_token_ids"
        elif token in self.banned(output):
            reason = "completes one of the bad_words"
        else:
            return None
        return (f"token {token} {reason}: allowed_token_ids, bad_words and the grammar left no "
                f"token to sample at this position")
