"""Stop strings, held-back text and chat continuation in the coordinator's text handling."""

from __future__ import annotations

import pytest

from coordinator.text import OutputText, TextCodec
from specdec_core.models import load_tokenizer


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec(load_tokenizer("smollm2"), "smollm2")


def feed(out: OutputText, ids: list[int], block: int) -> tuple[str, list[int], bool]:
    text, kept = "", []
    for i in range(0, len(ids), block):
        new = ids[i:i + block]
        delta, keep = out.add(new)
        text += delta
        if keep is not None:
            return text + out.flush(), kept + new[:keep], True
        kept += new
    return text + out.flush(), kept, False


@pytest.mark.parametrize("block", [1, 3, 7])
def test_stop_string_cuts_text_and_tokens(codec, block):
    ids = codec.tokenizer("The capital of France is Paris. It is lovely.", add_special_tokens=False)["input_ids"]
    text, kept, stopped = feed(OutputText(codec, ["Paris"]), ids, block)
    assert stopped and text == "The capital of France is "
    assert "Paris" in codec.decode(kept) and "lovely" not in codec.decode(kept)
    assert "Paris" not in codec.decode(kept[:-1])  # kept through the token completing the stop string


def test_text_that_may_become_a_stop_string_is_held_back(codec):
    out = OutputText(codec, ["Hello world"])
    ids = codec.tokenizer("Say Hello", add_special_tokens=False)["input_ids"]
    delta, keep = out.add(ids)
    assert keep is None and delta == "Say "  # "Hello" could still become "Hello world"
    assert out.flush() == "Hello"


def test_without_stop_strings_everything_streams(codec):
    ids = codec.tokenizer("one two three", add_special_tokens=False)["input_ids"]
    text, kept, stopped = feed(OutputText(codec, []), ids, 2)
    assert text == "one two three" and kept == ids and not stopped


def test_chat_continuation_appends_only_the_new_turn(codec):
    history = [{"role": "user", "content": "Hi"}]
    first = codec.encode_chat([], [], history)
    reply = codec.tokenizer("Hello! How can I help?", add_special_tokens=False)["input_ids"] + list(codec.eos_ids)
    committed = first + reply
    history = history + [{"role": "assistant", "content": "Hello! How can I help?"}]
    new = [{"role": "user", "content": "Tell me a joke"}]
    delta = codec.encode_chat(committed, history, new)
    whole = codec.tokenizer.apply_chat_template(history + new, add_generation_prompt=True, tokenize=False)
    assert codec.tokenizer.decode(committed + delta, skip_special_tokens=False) == whole


def test_chat_continuation_closes_a_reply_cut_short(codec):
    history = [{"role": "user", "content": "Count"}]
    committed = codec.encode_chat([], [], history) + codec.tokenizer("1 2 3", add_special_tokens=False)["input_ids"]
    history = history + [{"role": "assistant", "content": "1 2 3"}]
    delta = codec.encode_chat(committed, history, [{"role": "user", "content": "more"}])
    text = codec.tokenizer.decode(delta, skip_special_tokens=False)
    assert text.startswith("<|im_end|>") and text.endswith("<|im_start|>assistant\n")
