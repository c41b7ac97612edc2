"""Incremental detokenization with stop strings.

Text is released only when it is final: a byte-level token that ends inside a UTF-8
character waits for the rest, and the last `len(longest stop) - 1` characters are held
back until it is clear they do not start a stop string.

A fast tokenizer decodes through its Rust tokenizer directly (what transformers' `decode`
calls, with no clean-up of spaces): the engine thread decodes twice per token of every running
sequence, between two steps, so the wrapper's overhead adds up (docs/PERF.md).
"""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self._rust = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's own
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0  # decode context starts here (keeps spacing right)
        self.read_offset = 0  # tokens up to here are already in self.text
        self.text = ""  # all text decoded so far
        self.sent = 0  # characters of self.text already released

    def _decode(self, ids: list[int]) -> str:
        if self._rust is not None:
            return self._rust.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one token; return (text now safe to release, stopped by a stop string)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.stop:
            start = max(0, self.sent - self.holdback)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return self._release(len(self.text)), True
        return self._release(len(self.text) - self.holdback), False

    def flush(self) -> str:
        """At the end: release everything held back (a trailing partial character is dropped)."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent : upto]
        self.sent = upto
        return out
