"""Structured outputs: a constraint on what a request generates, compiled by llguidance, applied as
one more step of the logit processing that draft and target share (`sampling.adjust_logits`).

A constraint masks every position of the request's output: row j of a verify block is masked with
the grammar advanced through the committed output and the first j draft tokens, a model draft
masks each of its steps, and a suffix proposal is cut at its first token the grammar forbids
(`Grammars.allowed_prefix`). The grammar state is never the truth: it is rebuilt from the
committed tokens (`tokens[output_start:]`) on any call, in any process, so sessions moved between
replicas, retried or restored from Redis keep their constraint. Matchers are kept between calls
only to save that work: a pool per constraint, each matcher at some committed output, taken by the
call whose output extends it furthest and advanced to it. Pooled matchers only ever move forward:
a block's draft tokens advance a copy, and an output that extends no pooled matcher is replayed
on a new one. (With llguidance's rollback, a fresh stack committed tokens the grammar forbids in
about one round in three of 44 concurrent requests; no rollback, no such state.)

The end-of-sequence tokens (`Constraint.end_ids`) are allowed exactly where the output matches
the whole constraint, and they are all that is allowed once the grammar cannot go on.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec_core import metrics
from specdec_core.errors import InvalidArgument

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar's text, at most
MAX_CHOICES = 1024
MAX_GRAMMAR_SIZE = 200_000  # llguidance's grammar size limit (its default is 500,000)
LEXER_FUEL = 1_000_000  # llguidance's work bound for building the lexer: a too-slow grammar fails fast


@dataclass(frozen=True)
class Constraint:
    """kind: one of KINDS; spec: the schema (JSON text), regex, grammar, or the choices as a JSON
    list (json_object: empty). end_ids: the tokens that may end the output once it matches."""

    kind: str
    spec: str = ""
    end_ids: tuple[int, ...] = ()

    @property
    def field(self) -> str:
        return f"sampling.constraint.{self.kind}"

    @property
    def choices(self) -> list[str]:
        return json.loads(self.spec) if self.kind == "choice" else []

    def to_dict(self) -> dict:
        return {"kind": self.kind, "spec": self.spec, "end_ids": list(self.end_ids)}

    @classmethod
    def from_dict(cls, d: dict) -> Constraint:
        return cls(d["kind"], d.get("spec", ""), tuple(d.get("end_ids", ())))


def check_constraint(c: Constraint) -> None:
    """The checks that need no tokenizer (sizes, JSON text): InvalidArgument naming the field."""
    if c.kind not in KINDS:
        raise InvalidArgument("sampling.constraint", f"unknown kind {c.kind!r}; one of {', '.join(KINDS)}")
    if len(c.spec) > MAX_SPEC_CHARS:
        raise InvalidArgument(c.field, f"{len(c.spec)} characters; at most {MAX_SPEC_CHARS}")
    if c.kind == "json_schema":
        try:
            schema = json.loads(c.spec)
        except ValueError as exc:
            raise InvalidArgument(c.field, f"not JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidArgument(c.field, "a JSON schema is an object (or true/false)")
    if c.kind == "choice":
        choices = c.choices
        if not choices or len(choices) > MAX_CHOICES or not all(isinstance(s, str) and s for s in choices):
            raise InvalidArgument(c.field, f"1 to {MAX_CHOICES} non-empty strings")
    if c.kind in ("regex", "grammar") and not c.spec.strip():
        raise InvalidArgument(c.field, "must not be empty")


def grammar_text(c: Constraint) -> str:
    """The constraint as an llguidance grammar."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

    if c.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(c.spec)
    if c.kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}')
    if c.kind == "regex":
        return LLMatcher.grammar_from_regex(c.spec)
    if c.kind == "choice":  # JSON string literals are Lark string literals
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in c.choices))
    try:
        return LLMatcher.grammar_from_lark(any_to_lark(c.spec))
    except GbnfToLarkError as exc:
        raise InvalidArgument(c.field, f"GBNF does not convert: {exc}") from None


class _Entry:
    """A matcher that has consumed `tokens` (an output prefix) and nothing else."""

    __slots__ = ("matcher", "tokens")

    def __init__(self, matcher, tokens: list[int]):
        self.matcher = matcher
        self.tokens = tokens


class Grammars:
    """One process's constraints: the tokenizer they are compiled for (built on first use), the
    compiled grammars (bounded LRU: a repeated schema costs nothing) and the matcher pool (bounded
    LRU). Thread-safe: a matcher is used by one call at a time."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, max_grammars: int = 128,
                 max_matchers: int = 512):
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.max_grammars = max_grammars
        self.max_matchers = max_matchers
        self._tokenizer = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()  # (kind, spec) -> fresh matcher
        self._pool: OrderedDict[int, tuple[tuple[str, str], _Entry]] = OrderedDict()
        self.compiles = 0  # how many grammars were compiled (not found in the cache)

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._load_tokenizer(), n_vocab=self.vocab_size)
            return self._tokenizer

    def warm(self) -> Grammars:
        """Build the tokenizer in the background now, so that the first constrained call does not
        wait for it (a worker's first call would otherwise take a second longer)."""
        threading.Thread(target=lambda: self.tokenizer, name="grammar-warm-up", daemon=True).start()
        return self

    def check(self, c: Constraint) -> None:
        """Compile c (or find it compiled): InvalidArgument naming the field when it does not."""
        self._compiled_matcher(c)

    def masks(self, c: Constraint, tokens: Sequence[int], rows: int, output_start: int) -> torch.Tensor:
        """Allowed tokens [rows, V] (bool). Row j follows tokens[:len(tokens) - rows + 1 + j], as
        in `adjust_logits`; the output starts at tokens[output_start]. The end tokens are allowed
        where the output matches.

        The grammar advances through a draft token only where the row before it allows it (the
        mask itself decides, so a draft token is never judged by another test than its row's); the
        rows after a draft token its row forbids, or after an end token, are all True: that token
        is rejected whatever they say, or the output ends with it."""
        import llguidance.torch as llt

        base = len(tokens) - rows + 1
        output, ends = list(tokens[output_start:base]), self._ends(c)
        allowed = torch.ones(rows, self.vocab_size, dtype=torch.bool)
        if ends.intersection(output):  # the output has ended
            return allowed
        draft, end_ids = list(tokens[base:]), sorted(t for t in ends if t < self.vocab_size)
        bits = llt.allocate_token_bitmask(1, self.vocab_size)
        key, entry = self._take(c, output)
        try:  # the block's draft tokens advance a copy: the pooled matcher only ever moves forward
            matcher = entry.matcher.deep_copy() if draft and rows > 1 else entry.matcher
            for j in range(rows):
                llt.fill_next_token_bitmask(matcher, bits, 0)
                _check(matcher, c)
                allowed[j] = _unpack(bits, self.vocab_size)[0]
                allowed[j, end_ids] = matcher.is_accepting()
                if j == len(draft) or draft[j] in ends or not allowed[j, draft[j]]:
                    break
                if not matcher.consume_token(draft[j]):
                    _check(matcher, c)
        finally:
            self._give_back(key, entry)
        return allowed

    def allowed_prefix(self, c: Constraint, output: Sequence[int], draft: Sequence[int]) -> int:
        """How many of draft's tokens the grammar allows after the committed `output` (the request's
        generated tokens): a proposal is cut there. An end token counts where the output matches."""
        ends, started = self._ends(c), time.perf_counter()
        if ends.intersection(output):
            return len(draft)
        key, entry = self._take(c, list(output))
        try:  # on a copy: the pooled matcher only ever moves forward
            matcher, n = entry.matcher.deep_copy(), 0
            for token in _until_end(list(draft), ends):
                if not matcher.consume_token(token):
                    break
                n += 1
            if n < len(draft) and draft[n] in ends and not matcher.is_error() and matcher.is_accepting():
                n += 1
            return n
        finally:
            self._give_back(key, entry)
            metrics.GRAMMAR_SECONDS.labels("cut").inc(time.perf_counter() - started)

    def _ends(self, c: Constraint) -> set[int]:
        """The tokens that end an output: the constraint's, and the tokenizer's end of sequence."""
        return {*c.end_ids, self.tokenizer.eos_token}

    def _compiled_matcher(self, c: Constraint):
        import llguidance

        key = (c.kind, c.spec)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        check_constraint(c)
        started = time.perf_counter()
        grammar = grammar_text(c)
        limits = llguidance.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SIZE, initial_lexer_fuel=LEXER_FUEL)
        error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer, limits=limits)
        matcher = None if error else llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits)
        if matcher is not None and not matcher.is_error():  # the first mask builds the lexer, within its fuel
            import llguidance.torch as llt

            llt.fill_next_token_bitmask(matcher.deep_copy(), llt.allocate_token_bitmask(1, self.vocab_size), 0)
        if error or matcher.is_error():
            raise InvalidArgument(c.field, _first_line(messages[0] if messages else matcher.get_error()))
        metrics.GRAMMAR_SECONDS.labels("compile").inc(time.perf_counter() - started)
        with self._lock:
            self.compiles += 1
            self._compiled[key] = matcher
            while len(self._compiled) > self.max_grammars:
                self._compiled.popitem(last=False)
        return matcher

    def _take(self, c: Constraint, output: list[int]) -> tuple[tuple[str, str], _Entry]:
        """A matcher of c that has consumed exactly `output`: the pooled one whose tokens `output`
        extends the furthest, advanced to it, or a new one."""
        key = (c.kind, c.spec)
        with self._lock:
            best, shared = _extended(self._pool, key, output)
            entry = self._pool.pop(best)[1] if best is not None else None
        if entry is None:  # none the output extends: a new one replays it (matchers are never rolled back)
            entry, shared = _Entry(self._compiled_matcher(c).deep_copy(), []), 0
        rest = output[shared:]
        for token in rest:  # one token a call, the steps decoding took (not one call of many tokens)
            if not entry.matcher.consume_token(token):
                _check(entry.matcher, c)
                raise InvalidArgument(c.field, "the request's output so far does not match the constraint")
        entry.tokens += rest
        return key, entry

    def _give_back(self, key: tuple[str, str], entry: _Entry) -> None:
        if entry.matcher.is_error():
            return
        with self._lock:
            self._pool[id(entry)] = (key, entry)
            while len(self._pool) > self.max_matchers:
                self._pool.popitem(last=False)


def _check(matcher, c: Constraint) -> None:
    """A matcher that has failed (a limit of llguidance's hit at this output, e.g. a grammar too
    complex to follow within its step fuel) ends the request, with llguidance's reason; it never
    yields a mask."""
    if matcher.is_error():
        raise InvalidArgument(c.field, f"the constraint cannot be followed here: {_first_line(matcher.get_error())}")


def _until_end(tokens: list[int], ends: set[int]) -> list[int]:
    """tokens up to (not including) the first end token."""
    return next((tokens[:i] for i, t in enumerate(tokens) if t in ends), tokens)


def _unpack(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """An llguidance bitmask [N, ceil(V / 32)] (int32, bit i of word w: token 32 w + i) as bool [N, V]."""
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = (bits.unsqueeze(-1) >> shifts) & 1  # [N, W, 32]
    return allowed.reshape(bits.shape[0], -1)[:, :vocab_size].bool()


def _extended(pool: OrderedDict, key: tuple[str, str], output: list[int]) -> tuple[int | None, int]:
    """The pooled matcher of `key` whose tokens `output` extends the furthest, found cheaply: its
    last token is checked before the whole (None, -1 when none)."""
    best, shared = None, -1
    for handle, (k, e) in pool.items():
        n = len(e.tokens)
        if k == key and shared < n <= len(output) and (not n or e.tokens[-1] == output[n - 1]) \
                and e.tokens == output[:n]:
            best, shared = handle, n
    return best, shared


def _first_line(text: str) -> str:
    return " ".join(text.split())[:300]


def check_in(grammars: Grammars | None, c: Constraint | None) -> None:
    """A worker's check of a call's constraint, before any work: it compiles here (INVALID_ARGUMENT
    naming the field otherwise)."""
    if c is None:
        return
    if grammars is None:
        raise InvalidArgument("sampling.constraint", "this worker was started without constraint support")
    grammars.check(c)
