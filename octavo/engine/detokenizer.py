"""Incremental detokenization and stop strings for one sequence."""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

from octavo.params import SamplingParams

_PROMPT_CONTEXT = 6  # prompt tokens fed first, so the first output token gets its spacing right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._backend = tokenizer.backend
        self._stream = DecodeStream(ids=prompt_token_ids[-_PROMPT_CONTEXT:],
                                    skip_special_tokens=params.skip_special_tokens)
        # vLLM's rule for fast tokenizers: with special tokens kept and
        # spaces_between_special_tokens off, an added token right after another is its own
        # text, without the space a decoder may put before it.
        self._added: dict[int, str] | None = None
        if not params.skip_special_tokens and not params.spaces_between_special_tokens:
            self._added = {i: t.content
                           for i, t in self._backend.get_added_tokens_decoder().items()}
        self._last_added = False
        self._stops = params.stop_strings
        self._include_stop = params.include_stop_str_in_output
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self._sent = 0

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string when one appeared (text is then cut there)."""
        for tok in token_ids:
            piece = self._stream.step(self._backend, tok)
            if self._added is not None:
                added = self._added.get(tok)
                if added is not None and self._last_added:
                    piece = added
                self._last_added = added is not None
            if not piece:
                continue
            start = max(0, len(self.text) - self._hold)
            self.text += piece
            for stop in self._stops:
                at = self.text.find(stop, start)
                if at != -1:
                    self.text = self.text[:at + len(stop) if self._include_stop else at]
                    return stop
        return None

    def delta(self, finished: bool) -> str:
        """New text since the last call, holding back a tail that may begin a stop string."""
        end = len(self.text) if finished else max(self._sent, len(self.text) - self._hold)
        out = self.text[self._sent:end]
        self._sent = end
        return out
