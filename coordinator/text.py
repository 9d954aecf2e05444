"""Tokenizer, chat template, and incremental output text with stop strings."""

from __future__ import annotations

import os


class TextCodec:
    def __init__(self, tokenizer, name: str):
        self.tokenizer = tokenizer
        self.name = name
        eos = tokenizer.eos_token_id
        self.eos_ids: frozenset[int] = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))

    def encode_prompt(self, text: str, is_first_turn: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=is_first_turn)["input_ids"]

    def encode_chat(self, committed_ids: list[int], history: list[dict], new: list[dict]) -> list[int]:
        """Token ids that turn the committed sequence into the whole conversation, history + new,
        with an assistant turn opened. The template is rendered for the whole conversation; what
        the committed tokens already say (their decoded text, special tokens included) is cut off
        the front and only the rest is tokenized. A reply cut short (max tokens, stop string) thus
        gets its closing tags from the template."""
        text = self.tokenizer.apply_chat_template(history + new, add_generation_prompt=True, tokenize=False)
        if committed_ids:
            committed_text = self.tokenizer.decode(committed_ids, skip_special_tokens=False)
            text = text[len(os.path.commonprefix([committed_text, text])):]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class OutputText:
    """The text of a request's generated tokens, released as it becomes final.

    Text that could still turn into a stop string, or that ends in an incomplete character, is
    held back until the next tokens decide it.
    """

    def __init__(self, codec: TextCodec, stop: list[str]):
        self.codec = codec
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0

    def add(self, new_ids: list[int]) -> tuple[str, int | None]:
        """Append new_ids. Returns (text now final, None) or, when a stop string appeared,
        (the final text up to it, how many of new_ids to keep: through the token completing it)."""
        text = self.codec.decode(self.ids + new_ids)
        hit = self._find_stop(text)
        if hit is not None:
            keep = next(j for j in range(1, len(new_ids) + 1)
                        if self._find_stop(self.codec.decode(self.ids + new_ids[:j])) is not None)
            self.ids += new_ids[:keep]
            self.text = text[:hit]
            return self._release(len(self.text)), keep
        self.ids += new_ids
        self.text = text
        return self._release(len(text) - self._holdback(text)), None

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        delta = self.text[self.emitted:upto]
        self.emitted = upto
        return delta

    def _find_stop(self, text: str) -> int | None:
        start = max(0, self.emitted - max((len(s) for s in self.stop), default=0))
        hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        hold = len(text) - len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return hold
