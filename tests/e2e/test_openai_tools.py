"""Structured outputs and tool calling through the OpenAI-compatible API, driven by the official
`openai` SDK and by LangChain's `ChatOpenAI`, against a running stack with the embedded SmolLM2
model (Redis, draft, target, coordinator and the gateway, each its own process):

- the 22 schemas of benchmarks/schemas.py as `response_format` json_schema, greedy and sampled, 8
  requests at a time: every output ends by itself, parses and validates;
- the SDK's `chat.completions.parse` with a pydantic model; `json_object`; vLLM's `guided_*`;
- a tool round trip (`tool_choice` required and named): calls with ids, names and arguments that
  validate, finish reason `tool_calls`, streamed deltas that add up to the non-streamed answer,
  then the call and its result in the conversation and a text answer;
- LangChain: `bind_tools(..., tool_choice=...)`, a tool round trip, `with_structured_output`;
- constraints that do not compile: 400s naming the parameter they came from.
"""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field, conint

from stacks import in_parallel, start_stack

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from schemas import SCHEMAS, messages as ask  # noqa: E402

pytestmark = [pytest.mark.structured, pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 200
CITIES = ["Paris", "London", "Tokyo", "Lisbon"]
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": CITIES},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMETERS = {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
    "required": ["timezone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "description": "Get the current time in a time zone.",
                                      "parameters": TIME_PARAMETERS}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
TOOL_RESULT = '{"temp_c": 21}'


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = start_stack("smollm2", "smollm2", tmp_path_factory.mktemp("logs"), openai=True)
    yield stack
    stack.down()


@pytest.fixture(scope="module")
def sdk(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url(), api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(sdk) -> str:
    return sdk.models.list().data[0].id


# ----------------------------------------------------------------------------------------------
# Structured outputs


def test_every_schema_validates_greedy_and_sampled(sdk, model):
    """The 22 schemas as `response_format` json_schema, greedy and sampled (T = 0.8, seeded), 8
    requests at a time: every answer ends with `stop`, parses, and validates against its schema."""
    jobs = [(name, prompt, schema, temperature) for name, prompt, schema in SCHEMAS for temperature in (0, 0.8)]

    def run(job):
        name, prompt, schema, temperature = job
        return sdk.chat.completions.create(
            model=model, messages=ask(prompt), max_tokens=MAX_TOKENS, temperature=temperature, seed=7,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})

    failures, answers = [], {}
    for (name, _, schema, temperature), r in zip(jobs, in_parallel(run, jobs)):
        text = r.choices[0].message.content
        answers[name, temperature] = text
        try:
            assert r.choices[0].finish_reason == "stop", r.choices[0].finish_reason
            assert not r.choices[0].message.tool_calls
            jsonschema.validate(json.loads(text), schema)
        except (AssertionError, TypeError, ValueError, jsonschema.ValidationError) as exc:
            failures.append((name, temperature, (text or "")[:200], str(exc)[:200]))
    assert len(jobs) == 44 and not failures, failures
    # the temperature was applied: some sampled answers differ from the greedy ones
    assert any(answers[name, 0] != answers[name, 0.8] for name, _, _ in SCHEMAS)


class Species(str, Enum):
    cat = "cat"
    dog = "dog"
    parrot = "parrot"


class Pet(BaseModel):
    name: str = Field(min_length=1, max_length=20)
    species: Species
    age: conint(ge=0, le=30)
    size: Literal["small", "medium", "large"]
    vaccinated: bool


def test_sdk_parse_with_a_pydantic_model(sdk, model):
    """`chat.completions.parse(response_format=Model)`: the SDK's strict json_schema, answered with
    output that the SDK parses into an instance."""
    r = sdk.chat.completions.parse(model=model, messages=ask("Describe a family pet."), response_format=Pet,
                                   max_tokens=MAX_TOKENS, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    pet = choice.message.parsed
    assert isinstance(pet, Pet)
    assert 1 <= len(pet.name) <= 20 and 0 <= pet.age <= 30 and isinstance(pet.species, Species)
    assert json.loads(choice.message.content) == pet.model_dump(mode="json")


def test_json_object_and_vllm_forms(sdk, model):
    """`json_object` answers a JSON object; vLLM's `guided_choice` and `guided_regex` (chat, and the
    completions endpoint) match."""
    def json_object():
        return sdk.chat.completions.create(
            model=model, messages=ask("Describe a cat as a JSON object with the keys name and age only."),
            max_tokens=MAX_TOKENS, temperature=0, response_format={"type": "json_object"})

    def choice():
        return sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Is the sky green?"}], max_tokens=10, temperature=0,
            extra_body={"guided_choice": ["yes", "no", "maybe"]})

    def regex():
        return sdk.completions.create(model=model, prompt="The phone number of the office is", max_tokens=20,
                                      temperature=0, extra_body={"guided_regex": r" \d{3}-\d{4}"})

    obj, yes_no, phone = in_parallel(lambda f: f(), [json_object, choice, regex], workers=3)
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    assert yes_no.choices[0].message.content in ("yes", "no", "maybe") and yes_no.choices[0].finish_reason == "stop"
    text = phone.choices[0].text
    assert len(text) == 9 and text[0] == " " and text[4] == "-" and (text[1:4] + text[5:]).isdigit(), text
    assert phone.choices[0].finish_reason == "stop"


# ----------------------------------------------------------------------------------------------
# Tool calling


def streamed_calls(stream) -> tuple[list[dict], str | None, str]:
    """(calls as {id, name, arguments}, the finish reason, content) from a chat stream's deltas,
    accumulated by index as OpenAI's clients do."""
    calls: dict[int, dict] = {}
    finishes, content = [], ""
    for chunk in stream:
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        content += c.delta.content or ""
        for d in c.delta.tool_calls or []:
            if d.index not in calls:  # a call's first delta: its id, type and name, no arguments yet
                assert d.id and d.type == "function" and d.function.name and not d.function.arguments, d
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and not d.function.name
                calls[d.index]["arguments"] += d.function.arguments or ""
        if c.finish_reason:
            finishes.append(c.finish_reason)
    assert sorted(calls) == list(range(len(calls))) and len(finishes) == 1, (calls, finishes)
    return [calls[i] for i in sorted(calls)], finishes[0], content


def check_calls(calls: list[dict], names: set[str]) -> None:
    ids = [c["id"] for c in calls]
    assert calls and len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids), ids
    for c in calls:
        assert c["name"] in names, c
        jsonschema.validate(json.loads(c["arguments"]), PARAMETERS[c["name"]])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_tool_round_trip_streamed_and_not(sdk, model, tool_choice):
    """A required (or named) call, non-streamed and streamed (greedy: the same calls), then the
    calls and their results in the conversation and a text answer with tool_choice none."""
    request = dict(model=model, messages=QUESTION, tools=TOOLS, tool_choice=tool_choice, max_tokens=MAX_TOKENS,
                   temperature=0)
    whole, (streamed, stream_finish, stream_content) = in_parallel(lambda f: f(), [
        lambda: sdk.chat.completions.create(**request),
        lambda: streamed_calls(sdk.chat.completions.create(**request, stream=True))], workers=2)

    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None  # calls only: a constrained answer has no other text
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls]
    assert all(c.type == "function" for c in choice.message.tool_calls)
    names = {"get_weather"} if isinstance(tool_choice, dict) else set(PARAMETERS)
    check_calls(calls, names)
    if isinstance(tool_choice, dict):
        assert len(calls) == 1
    assert stream_finish == "tool_calls" and stream_content == ""
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in calls]

    # the calls and their results back in the conversation
    followup = QUESTION + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                        for c in calls]},
        *({"role": "tool", "tool_call_id": c["id"], "content": TOOL_RESULT} for c in calls)]
    answer = sdk.chat.completions.create(model=model, messages=followup, tools=TOOLS, tool_choice="none",
                                         max_tokens=40, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    # the calls and the results were rendered into the prompt: it grew by more than the calls' tokens
    assert answer.usage.prompt_tokens > whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_sdk_stream_helper_accumulates_a_named_call(sdk, model):
    """The SDK's `chat.completions.stream` helper puts the streamed deltas together into the same
    call as the non-streamed answer."""
    request = dict(model=model, messages=[{"role": "user", "content": "What time is it in Tokyo?"}], tools=TOOLS,
                   tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=MAX_TOKENS,
                   temperature=0)
    with sdk.chat.completions.stream(**request) as stream:
        final = stream.get_final_completion()
    whole = sdk.chat.completions.create(**request)
    for r in (final, whole):
        assert r.choices[0].finish_reason == "tool_calls"
        [call] = r.choices[0].message.tool_calls
        assert call.function.name == "get_time" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), TIME_PARAMETERS)
    assert final.choices[0].message.tool_calls[0].function.arguments == \
        whole.choices[0].message.tool_calls[0].function.arguments


# ----------------------------------------------------------------------------------------------
# LangChain


class City(BaseModel):
    """A city and what it is known for."""

    name: str = Field(min_length=1, max_length=30)
    country: str = Field(min_length=1, max_length=30)
    population_millions: conint(ge=0, le=50)
    capital: bool


def test_langchain_tools_and_structured_output(stack, model):
    """LangChain's ChatOpenAI against the gateway: `bind_tools` with a forced tool gives a call with
    valid arguments; the call and a ToolMessage back give a text answer; `with_structured_output`
    (json_schema) gives a valid instance."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_core.utils.function_calling import convert_to_openai_tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "London", "Tokyo", "Lisbon"], unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city."""
        return TOOL_RESULT

    def chat(max_tokens: int) -> ChatOpenAI:
        return ChatOpenAI(base_url=stack.url(), api_key="none", model=model, temperature=0, max_tokens=max_tokens,
                          max_retries=0, timeout=300)

    llm = chat(MAX_TOKENS)
    question = HumanMessage("What is the weather like in Lisbon?")

    def tools():
        return llm.bind_tools([get_weather], tool_choice="get_weather").invoke([question])

    def structured():
        return llm.with_structured_output(City, method="json_schema").invoke("Describe the city of Rome.")

    called, city = in_parallel(lambda f: f(), [tools, structured], workers=2)
    assert isinstance(called, AIMessage) and len(called.tool_calls) == 1, called
    call = called.tool_calls[0]
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], convert_to_openai_tool(get_weather)["function"]["parameters"])
    assert called.response_metadata["finish_reason"] == "tool_calls"

    assert isinstance(city, City)
    assert 1 <= len(city.name) <= 30 and 0 <= city.population_millions <= 50

    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    answer = chat(40).bind_tools([get_weather], tool_choice="none").invoke([question, called, result])
    assert isinstance(answer, AIMessage) and answer.content and not answer.tool_calls
    assert answer.response_metadata["finish_reason"] in ("stop", "length")


# ----------------------------------------------------------------------------------------------
# Constraints that do not compile


@pytest.mark.parametrize("kwargs, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "wat"}}}},
     "response_format"),
    ({"extra_body": {"guided_regex": "a["}}, "guided_regex"),
    ({"extra_body": {"guided_grammar": "start: undefined_rule\n"}}, "guided_grammar"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: ("}}}, "structured_outputs.grammar"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "wat"}}}}}], "tool_choice": "required"}, "tools"),
], ids=["json_schema", "guided_regex", "guided_grammar", "structured_outputs", "tool_parameters"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_constraint_that_does_not_compile_is_a_400_naming_its_param(sdk, model, kwargs, param, stream):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=10, temperature=0, stream=stream,
                                    **kwargs)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body
    assert err.value.body["type"] == "invalid_request_error"
