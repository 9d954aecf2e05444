"""Stop strings, held-back text and chat continuation in the coordinator's text handling."""

from __future__ import annotations

import random

import pytest

from coordinator.text import OutputText, TextCodec
from specdec_core.engine.models import load_tokenizer
from tiny_models import ENGINE


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec(load_tokenizer("smollm2", ENGINE.cache_dir), "smollm2")


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


class FullDecodeOutputText:
    """The reference: decodes every generated id and searches all of the text each round (O(n))."""

    def __init__(self, codec: TextCodec, stop: list[str]):
        self.codec, self.stop, self.ids, self.text, self.emitted = codec, stop, [], "", 0

    def add(self, new_ids):
        text = self.codec.decode(self.ids + new_ids)
        if self._find_stop(text) is not None:
            keep = next(j for j in range(1, len(new_ids) + 1)
                        if self._find_stop(self.codec.decode(self.ids + new_ids[:j])) is not None)
            self.ids += new_ids[:keep]
            self.text = text[:self._find_stop(text)]
            return self._release(len(self.text)), keep
        self.ids += new_ids
        self.text = text
        hold = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:
            hold = max([hold] + [k for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])])
        return self._release(len(text) - hold), None

    def flush(self):
        return self._release(len(self.text))

    def _release(self, upto):
        upto = max(upto, self.emitted)
        delta, self.emitted = self.text[self.emitted:upto], upto
        return delta

    def _find_stop(self, text):
        hits = [i for s in self.stop if (i := text.find(s)) >= 0]
        return min(hits) if hits else None


def run_rounds(out, ids: list[int], blocks: list[int]) -> list[tuple[str, int | None, str]]:
    """(delta, keep, text) after every round, then ("flush", None, text)."""
    trace, i = [], 0
    for block in blocks:
        delta, keep = out.add(ids[i:i + block])
        trace.append((delta, keep, out.text))
        i += block
        if keep is not None or i >= len(ids):
            break
    return trace + [(out.flush(), None, out.text)]


@pytest.mark.parametrize("seed", range(40))
def test_incremental_text_matches_decoding_everything(codec, seed):
    """Same deltas, same kept tokens, same .text as decoding all ids every round, on text with
    multi-token characters, special tokens, and random ids (broken UTF-8 included)."""
    rng = random.Random(seed)
    sample = "Héllo wörld! 🙂 日本語のテキスト. The capital of France is Paris.\n  code:  x = 1  # 🚀🚀"
    ids = codec.tokenizer(sample * 3, add_special_tokens=False)["input_ids"]
    if seed % 2:  # what a random tiny model emits: any id, special ones included
        ids = [rng.randrange(codec.tokenizer.vocab_size) for _ in range(300)]
    elif seed % 4 == 2:
        ids = ids[:40] + [codec.tokenizer.convert_tokens_to_ids("<|im_end|>")] + ids[40:]
    text = codec.decode(ids)
    stop = [text[i:i + rng.randint(1, 6)] for i in rng.sample(range(len(text) - 6), rng.randint(0, 3))]
    stop += rng.sample(["Paris", "🙂", "\n", "wörld", "zzz never", "x = 1"], rng.randint(0, 2))
    blocks = [rng.randint(1, 6) for _ in ids]
    expected = run_rounds(FullDecodeOutputText(codec, stop), ids, blocks)
    assert run_rounds(OutputText(codec, stop), ids, blocks) == expected


class CountingCodec:
    """Counts the token ids passed to decode."""

    def __init__(self, codec: TextCodec):
        self.codec, self.decoded = codec, 0

    def decode(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return self.codec.decode(ids)


@pytest.mark.capacity
@pytest.mark.parametrize("block", [1, 5])
def test_cost_per_round_is_flat_in_output_length(codec, block):
    """Tokens decoded and characters searched for stop strings per round do not grow with the output."""
    ids = codec.tokenizer("The quick brown fox jumps over the lazy dog. " * 600, add_special_tokens=False)["input_ids"]
    assert len(ids) >= 1000 * 5
    counting = CountingCodec(codec)
    out = OutputText(counting, ["never appears", "lazy cat"])
    searched = []
    find_stop = out._find_stop
    out._find_stop = lambda text: searched.append(len(text)) or find_stop(text)
    decoded = []
    for i in range(0, 1000 * block, block):
        counting.decoded = 0
        searched.clear()
        assert out.add(ids[i:i + block])[1] is None
        decoded.append(counting.decoded)
        assert searched and max(searched) <= 2 * len("never appears") + 16 * block  # new text + stop lengths
    assert decoded[9] == decoded[99] == decoded[999] <= 3 * block
    assert out.text == codec.decode(ids[:1000 * block])
