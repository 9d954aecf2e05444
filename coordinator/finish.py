"""When a request ends. The rules, in the order they apply to a round's new tokens:

1. at most the tokens the request may still generate;
2. through the first stop token (the model's end-of-sequence tokens and the request's stop ids):
   STOP_TOKEN;
3. up to the end of the first stop string in the text: STOP_STRING;
4. the request has generated max_new_tokens: LENGTH;
5. the session fills the model's context: CONTEXT.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.request import Finish
from coordinator.text import OutputText


@dataclass(frozen=True)
class StopRule:
    stop_ids: frozenset[int]
    max_new_tokens: int
    max_context: int

    def room(self, generated: int, context_len: int) -> int:
        """The most draft tokens a round may verify: one token is the target's own."""
        return min(self.max_new_tokens - generated, self.max_context - context_len) - 1

    def cut(self, new_ids: list[int], generated: int, context_len: int, out: OutputText
            ) -> tuple[list[int], str, Finish | None]:
        """The round's tokens the request keeps, their text, and why the request ends (None: it goes on)."""
        kept, finish = cut_tokens(new_ids, self.max_new_tokens - generated, self.stop_ids)
        text, stop_at = out.add(kept)
        if stop_at is not None:
            kept, finish = kept[:stop_at], Finish.STOP_STRING
        if finish is None:
            finish = limit_reached(generated + len(kept), self.max_new_tokens, context_len + len(kept),
                                   self.max_context)
        return kept, text, finish


def cut_tokens(new_ids: list[int], remaining: int, stop_ids: frozenset[int]) -> tuple[list[int], Finish | None]:
    """Rules 1 and 2."""
    new_ids = new_ids[:remaining]
    for j, token in enumerate(new_ids):
        if token in stop_ids:
            return new_ids[:j + 1], Finish.STOP_TOKEN
    return new_ids, None


def limit_reached(generated: int, max_new_tokens: int, context_len: int, max_context: int) -> Finish | None:
    """Rules 4 and 5."""
    if generated >= max_new_tokens:
        return Finish.LENGTH
    if context_len >= max_context:
        return Finish.CONTEXT
    return None
