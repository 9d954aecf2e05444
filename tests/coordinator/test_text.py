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


WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "parameters": '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}'}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tools_by_the_default_rendering(codec):
    """A template without tools (SmolLM2's): the functions in the first system message, calls as
    <tool_call> blocks, results as a user message of <tool_response> blocks."""
    assert not codec.template_takes_tools
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}]},
                    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
                    {"role": "tool", "content": "22C", "tool_call_id": "call_2"}]
    text = codec.render_chat(conversation, [WEATHER])
    system = text[:text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and system.count("<|im_start|>") == 1
    assert '{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", ' \
           '"parameters": {"type": "object"' in system
    assert "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>" in system
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22C\n</tool_response>" \
           "<|im_end|>\n<|im_start|>assistant\n" in text
    no_system = codec.render_chat(conversation[1:2], [WEATHER])
    assert no_system.startswith("<|im_start|>system\n# Tools\n") and "SmolLM" not in no_system
    assert codec.render_chat(conversation[:2]) == codec.tokenizer.apply_chat_template(
        conversation[:2], add_generation_prompt=True, tokenize=False)  # no tools: as before


def test_a_session_with_tools_continues_its_committed_tokens(codec):
    """Turn one asks with tools and the model calls; turn two brings the result: only the new text
    is tokenized after the committed tokens, and together they are the whole conversation."""
    first = [{"role": "user", "content": "Weather in Paris?"}]
    committed = codec.encode_chat([], [], first, [WEATHER])
    committed += codec.tokenizer(CALL, add_special_tokens=False)["input_ids"] + list(codec.eos_ids)
    history = first + [{"role": "assistant", "content": CALL}]  # the session keeps the text generated
    new = [{"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    delta = codec.encode_chat(committed, history, new, [WEATHER])
    whole = codec.render_chat(history + new, [WEATHER])
    assert codec.tokenizer.decode(committed + delta, skip_special_tokens=False) == whole
    assert codec.tokenizer.decode(delta, skip_special_tokens=False).startswith("\n<|im_start|>user\n<tool_response>")


def test_tools_by_a_template_that_takes_them(codec):
    """A template that takes tools gets them, the calls and the tool messages in Hugging Face's shapes."""
    import copy

    tokenizer = copy.deepcopy(codec.tokenizer)
    tokenizer.chat_template = (
        "{% for t in tools or [] %}[tool {{ t.function.name }}: {{ t.function.parameters.required | tojson }}]"
        "{% endfor %}{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }}]"
        "{% endfor %}{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")
    with_tools = TextCodec(tokenizer, "custom")
    assert with_tools.template_takes_tools
    text = with_tools.render_chat([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "get_weather",
                                                             "arguments": '{"city": "Oslo"}'}]},
        {"role": "tool", "content": "rain", "tool_call_id": "c1"}], [WEATHER])
    assert text == ('[tool get_weather: ["city"]]<user>Weather?<assistant>[call c1 get_weather Oslo]'
                    "<tool>rain[for c1]<assistant>")
