"""Structured-output constraints (specdec_core/engine/grammar.py) on SmolLM2's real tokenizer: the
masks of a verify block, end tokens, cutting proposals, the matcher pool, bad constraints."""

from __future__ import annotations

import json

import pytest
import torch

from specdec_core.engine.grammar import Constraint, Grammars
from specdec_core.engine.models import load_tokenizer
from specdec_core.engine.sampling import GREEDY, adjust_logits, sampling_from_dict, sampling_to_dict
from specdec_core.errors import InvalidArgument
from tiny_models import ENGINE

pytestmark = pytest.mark.structured

EOS = 2  # SmolLM2's <|im_end|>
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2", ENGINE.cache_dir)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(lambda: tokenizer, len(tokenizer))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def json_constraint() -> Constraint:
    return Constraint("json_schema", json.dumps(SCHEMA), (EOS,))


def test_block_rows_follow_the_draft_tokens_before_them(grammars, tokenizer):
    """Row j of a verify block is masked with the grammar advanced through the first j draft
    tokens: each valid draft token is allowed in its own row, and the row after the output is
    complete allows the end token alone."""
    out = encode(tokenizer, '{"name": "Bob", "age": 42}')
    c = json_constraint()
    k = 4  # the last 4 output tokens are a draft block
    masks = grammars.masks(c, PROMPT + out, k + 1, len(PROMPT))
    assert masks.shape == (k + 1, len(tokenizer))
    for j, token in enumerate(out[-k:]):
        assert masks[j, token], f"row {j} forbids the draft token it should allow"
        assert not masks[j, EOS], "the end token is allowed before the output matches"
    assert masks[k].nonzero().flatten().tolist() == [EOS]
    # the same rows one at a time (plain decoding) give the same masks
    for j in range(k + 1):
        alone = grammars.masks(c, PROMPT + out[:len(out) - k + j], 1, len(PROMPT))
        assert torch.equal(alone[0], masks[j])


def test_rows_after_a_forbidden_or_end_token_allow_everything(grammars, tokenizer):
    c = json_constraint()
    bad = encode(tokenizer, "hello")
    masks = grammars.masks(c, PROMPT + [bad[0], 9], 3, len(PROMPT))  # a draft block of 2 after no output
    assert not masks[0, bad[0]]  # the output must start with '{'
    assert masks[1:].all()  # the draft token before them is rejected whatever they say
    done = encode(tokenizer, '{"name":"A","age":1}')
    after_end = grammars.masks(c, PROMPT + done + [EOS, 11], 2, len(PROMPT))
    assert after_end[1].all()


def test_a_proposal_is_cut_at_the_first_forbidden_token(grammars, tokenizer):
    c = json_constraint()
    out = encode(tokenizer, '{"name": "Bob", "age": 42}')
    assert grammars.allowed_prefix(c, out[:3], out[3:]) == len(out) - 3
    assert grammars.allowed_prefix(c, out[:3], out[3:] + [EOS, 17]) == len(out) - 3 + 1  # the end token counts
    assert grammars.allowed_prefix(c, out[:3], out[3:-1] + [EOS]) == len(out) - 4  # not before the object closes
    assert grammars.allowed_prefix(c, [], encode(tokenizer, "no json")) == 0


def test_choice_regex_grammar_and_json_object(grammars, tokenizer):
    for c, good, bad in [
        (Constraint("choice", json.dumps(["yes", "no way"]), (EOS,)), "no way", "nope"),
        (Constraint("regex", "[0-9]{4}-[0-9]{2}-[0-9]{2}", (EOS,)), "2025-03-14", "2025/03"),
        (Constraint("grammar", 'start: "(" start ")" | "x"', (EOS,)), "((x))", "(x("),
        (Constraint("grammar", 'root ::= "a" root | "b"', (EOS,)), "aab", "aac"),  # GBNF, converted
        (Constraint("json_object", "", (EOS,)), '{"k": [1, 2]}', "[1]"),
    ]:
        good_ids, bad_ids = encode(tokenizer, good), encode(tokenizer, bad)
        assert grammars.allowed_prefix(c, [], good_ids + [EOS]) == len(good_ids) + 1, c
        assert grammars.allowed_prefix(c, [], bad_ids) < len(bad_ids), c


def test_masking_is_part_of_the_shared_logit_processing(grammars, tokenizer):
    """adjust_logits masks with the constraint: argmax of random logits is always allowed, and a
    sampled row gives forbidden tokens probability 0."""
    cfg = sampling_from_dict({**sampling_to_dict(GREEDY), "constraint": json_constraint().to_dict(), "temperature": 1.0})
    cfg = type(cfg)(**{**cfg.__dict__, "output_start": len(PROMPT)})
    out = encode(tokenizer, '{"name": "Al')
    torch.manual_seed(0)
    logits = torch.randn(2, len(tokenizer))
    adjusted = adjust_logits(logits, cfg, PROMPT + out, grammars)
    masks = grammars.masks(cfg.constraint, PROMPT + out, 2, len(PROMPT))
    assert torch.equal(torch.isfinite(adjusted), masks)
    assert masks[0, adjusted[0].argmax()]
    with pytest.raises(ValueError):
        adjust_logits(logits, cfg, PROMPT + out)  # a constrained request without the process's grammars


def test_the_session_record_keeps_the_constraint():
    c = json_constraint()
    cfg = sampling_from_dict({**sampling_to_dict(GREEDY), "constraint": c.to_dict()})
    assert cfg.constraint == c
    assert sampling_from_dict(sampling_to_dict(cfg)) == cfg
    assert sampling_from_dict({"temperature": 0.0}).constraint is None  # records written before constraints


def test_matchers_are_reused_and_rebuilt_from_the_committed_output(tokenizer):
    grammars = Grammars(lambda: tokenizer, len(tokenizer), max_matchers=2)
    c = json_constraint()
    out = encode(tokenizer, '{"name": "Bob", "age": 42}')
    reference = [grammars.masks(c, PROMPT + out[:i], 1, len(PROMPT))[0] for i in range(len(out))]
    assert grammars.compiles == 1  # one compile for every call of the same constraint
    other = Constraint("regex", "[a-z]+", (EOS,))
    for i in reversed(range(len(out))):  # backwards: no pooled matcher is extended by the call: a new one replays it
        grammars.masks(other, PROMPT + encode(tokenizer, "abc"), 1, len(PROMPT))  # churns the pool of 2
        assert torch.equal(grammars.masks(c, PROMPT + out[:i], 1, len(PROMPT))[0], reference[i])
    assert len(grammars._pool) <= 2


@pytest.mark.parametrize("c, field, words", [
    (Constraint("json_schema", "{not json"), "sampling.constraint.json_schema", "not JSON"),
    (Constraint("json_schema", '{"type": "wat"}'), "sampling.constraint.json_schema", "wat"),
    (Constraint("json_schema", "[1]"), "sampling.constraint.json_schema", "object"),
    (Constraint("regex", "a["), "sampling.constraint.regex", "unclosed"),
    (Constraint("regex", ""), "sampling.constraint.regex", "empty"),
    (Constraint("grammar", "start: undefined_rule"), "sampling.constraint.grammar", "undefined_rule"),
    (Constraint("choice", "[]"), "sampling.constraint.choice", "non-empty"),
    (Constraint("regex", "a" * 70_000), "sampling.constraint.regex", "at most"),
    (Constraint("nonsense", "x"), "sampling.constraint", "unknown kind"),
])
def test_bad_constraints_name_their_field(grammars, c, field, words):
    with pytest.raises(InvalidArgument) as err:
        grammars.check(c)
    assert err.value.field == field
    assert words in str(err.value)


def test_a_grammar_too_large_is_refused_before_compiling(grammars):
    """A size bound, not a timer: the same grammar is refused on any machine; one just under it compiles."""
    words = [f'"w{i}" "{i}"' for i in range(6000)]
    huge = "start: " + " | ".join(words)
    assert len(huge) > 64 * 1024
    with pytest.raises(InvalidArgument) as err:
        grammars.check(Constraint("grammar", huge))
    assert err.value.field == "sampling.constraint.grammar" and "at most" in str(err.value)
    grammars.check(Constraint("grammar", "start: " + " | ".join(words[:3000])))


def test_a_failed_matcher_ends_the_request_instead_of_allowing_everything(tokenizer):
    """llguidance writes no mask once its matcher has failed (a limit hit at some output), and a
    preallocated mask allows every token: masks must raise, naming the field, never return it."""
    grammars = Grammars(lambda: tokenizer, len(tokenizer))
    c = json_constraint()
    out = encode(tokenizer, '{"name": "Bob"')
    grammars.masks(c, PROMPT + out, 1, len(PROMPT))
    (_, entry), = grammars._pool.values()
    assert not entry.matcher.consume_token(encode(tokenizer, "}")[0] + 1)  # a token it refuses: it fails
    assert entry.matcher.is_error()
    with pytest.raises(InvalidArgument) as err:  # the same output again: the failed matcher is the one it finds
        grammars.masks(c, PROMPT + out, 1, len(PROMPT))
    assert err.value.field == "sampling.constraint.json_schema" and "cannot be followed" in str(err.value)
    fresh = Grammars(lambda: tokenizer, len(tokenizer)).masks(c, PROMPT + out, 1, len(PROMPT))
    assert torch.equal(grammars.masks(c, PROMPT + out, 1, len(PROMPT)), fresh)  # the failed one was not pooled again
