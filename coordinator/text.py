"""Tokenizer, chat template (with tools), and incremental output text with stop strings.

Tools reach the prompt through the model's chat template when it takes them (its source mentions
`tools`: Qwen's, Hermes', Llama 3.1's, Mistral's): the template gets OpenAI/Hugging Face shapes,
`tools=[{"type": "function", "function": {name, description, parameters}}]`, assistant
`tool_calls=[{"id", "type": "function", "function": {"name", "arguments": {...}}}]` and `tool`
messages. Otherwise, by the default (docs/api.md, "Tool calling"), Hermes/Qwen style:

- the functions are listed in a system message (appended to the first system message, if any, else
  one of its own first): `TOOLS_PROMPT`, one JSON line per function, asking for calls written as
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`;
- an assistant's tool calls are its content followed by such blocks, one per call, a newline apart;
- tool results (consecutive `tool` messages together) are a user message of
  `<tool_response>\n...\n</tool_response>` blocks.
"""

from __future__ import annotations

import json
import os

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class TextCodec:
    def __init__(self, tokenizer, name: str):
        self.tokenizer = tokenizer
        self.name = name
        eos = tokenizer.eos_token_id
        self.eos_ids: frozenset[int] = frozenset([eos] if isinstance(eos, int) else (eos or []))
        template = getattr(tokenizer, "chat_template", None)
        self.has_chat_template = bool(template)
        self.template_takes_tools = isinstance(template, str) and "tools" in template

    def encode_prompt(self, text: str, is_first_turn: bool) -> list[int]:
        return self.tokenizer(text, add_special_tokens=is_first_turn)["input_ids"]

    def encode_chat(self, committed_ids: list[int], history: list[dict], new: list[dict],
                    tools: list[dict] | None = None) -> list[int]:
        """Token ids that turn the committed sequence into the whole conversation, history + new,
        with an assistant turn opened. The template is rendered for the whole conversation; what
        the committed tokens already say (their decoded text, special tokens included) is cut off
        the front and only the rest is tokenized. A reply cut short (max tokens, stop string) thus
        gets its closing tags from the template. A session continues as it began when every
        request gives the same tools."""
        text = self.render_chat(history + new, tools)
        if committed_ids:
            committed_text = self.tokenizer.decode(committed_ids, skip_special_tokens=False)
            text = text[len(os.path.commonprefix([committed_text, text])):]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The conversation's text with an assistant turn opened; tools as the module says."""
        if self.template_takes_tools:
            return self.tokenizer.apply_chat_template([_template_message(m) for m in messages],
                                                      tools=[_template_tool(t) for t in tools] if tools else None,
                                                      add_generation_prompt=True, tokenize=False)
        return self.tokenizer.apply_chat_template(default_tool_messages(messages, tools or []),
                                                  add_generation_prompt=True, tokenize=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens included), as log-probabilities report it."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _arguments(text: str):
    """A tool call's arguments (JSON text) as an object, or the text itself if it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _parameters(text: str) -> dict:
    return json.loads(text) if text else {"type": "object", "properties": {}}


def _template_tool(tool: dict) -> dict:
    return {"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                             "parameters": _parameters(tool["parameters"])}}


def _template_message(m: dict) -> dict:
    out = {"role": m["role"], "content": m["content"]}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["name"], "arguments": _arguments(c["arguments"])}}
                             for c in m["tool_calls"]]
    for key in ("tool_call_id", "name"):
        if m.get(key):
            out[key] = m[key]
    return out


def tool_call_text(name: str, arguments: str) -> str:
    """One call as the default asks the model to write it."""
    call = json.dumps({"name": name, "arguments": _arguments(arguments)}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def default_tool_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation in roles and content only, tools rendered by the default (module docstring)."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if i and messages[i - 1]["role"] == "tool":  # one user message for consecutive results
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            continue
        content = m["content"]
        if m.get("tool_calls"):
            calls = [tool_call_text(c["name"], c["arguments"]) for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        out.append({"role": m["role"], "content": content})
    if tools:
        listing = "\n".join(json.dumps(_template_tool(t), ensure_ascii=False) for t in tools)
        prompt = TOOLS_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0]["content"] += "\n\n" + prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


class OutputText:
    """The text of a request's generated tokens, released as it becomes final.

    Text that could still turn into a stop string, or that ends in an incomplete character, is
    held back until the next tokens decide it.

    A round decodes and searches O(new tokens + the longest stop string), however long the output
    already is (`.text` is still kept whole, a plain string copy).
    New tokens are decoded after a short window of the tokens before them, whose own text is then
    cut off (the prefix/read offsets of TGI's and vLLM's incremental detokenization): the window
    gives the tokenizer the context it needs (a leading space, say). A stop string is looked for
    only where it can newly appear: one that ended in earlier text was found then, so it ends in
    text that is new or still unreleased, and starts at most its own length before that.
    """

    def __init__(self, codec: TextCodec, stop: list[str]):
        self.codec = codec
        self.stop = stop
        self.max_stop = max(map(len, stop), default=0)
        self.ids: list[int] = []
        self.text = ""  # all of it so far; may end in an incomplete character
        self.emitted = 0
        # ids[:_read] decode to text[:_settled], which ends in a whole character; ids[_prefix:_read]
        # is the window, and _head its text.
        self._prefix = 0
        self._read = 0
        self._settled = 0
        self._head = ""

    def add(self, new_ids: list[int]) -> tuple[str, int | None]:
        """Append new_ids. Returns (text now final, None) or, when a stop string appeared,
        (the final text up to it, how many of new_ids to keep: through the token completing it)."""
        start = max(0, min(self.emitted, self._settled) - self.max_stop)
        before = self.text[start:self._settled]
        tail = self._decode_unsettled(new_ids)
        window = before + tail  # text[start:] once new_ids are in
        hit = self._find_stop(window)
        if hit is not None:
            keep = next(j for j in range(1, len(new_ids) + 1)
                        if self._find_stop(before + self._decode_unsettled(new_ids[:j])) is not None)
            self.ids += new_ids[:keep]
            self.text = self.text[:start] + window[:hit]
            return self._release(len(self.text)), keep
        self.ids += new_ids
        self.text = self.text[:self._settled] + tail
        if tail and not tail.endswith("\ufffd"):  # ends in a whole character: the window moves on
            self._prefix, self._read, self._settled = self._read, len(self.ids), len(self.text)
            self._head = self.codec.decode(self.ids[self._prefix:self._read])
        return self._release(len(self.text) - self._holdback(window)), None

    def flush(self) -> str:
        return self._release(len(self.text))

    def _decode_unsettled(self, new_ids: list[int]) -> str:
        """The text of ids[_read:] + new_ids, decoded after the window."""
        return self.codec.decode(self.ids[self._prefix:] + new_ids)[len(self._head):]

    def _release(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        delta = self.text[self.emitted:upto]
        self.emitted = upto
        return delta

    def _find_stop(self, text: str) -> int | None:
        hits = [i for s in self.stop if (i := text.find(s)) >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        hold = len(text) - len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return hold
