"""Structured outputs and forced tool calls on the real engine, through each official SDK (issue 18): whatever the
tiny model would have written, the grammar holds it to the schema (10 seeded tries each, sent at once), the record
marks the constrained tokens, and the trainer leaves them out of the loss unless told otherwise."""

import asyncio
import concurrent.futures
import functools
import json

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest
from google import genai
from google.genai import types as gtypes
from pydantic import BaseModel

from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT
from polar_lab.trajectory import prefix_merging
from tests.conftest import session_calls
from tests.shapes import SURFACES, provider_error

TRIES = 10
QUESTION = "What is 12*7? Answer with the value and a short explanation."


class Answer(BaseModel):
    value: int
    explanation: str
    steps: list[str]


SCHEMA = Answer.model_json_schema()
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather for a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "clock", "description": "The time in a zone.", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
TOOLS = [CALC_TOOL, WEATHER, CLOCK]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _valid(text: str, schema=SCHEMA) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def tries(one):
    """[one(0), ..., one(TRIES - 1)], sent at once (a seed per call where the API takes one): the engine samples them
    concurrently, usually in one batch, as it does a harness's concurrent runs."""
    with concurrent.futures.ThreadPoolExecutor(TRIES) as pool:
        return list(pool.map(one, range(TRIES)))


def _openai(session, client=openai.OpenAI):
    return client(base_url=session.openai_base_url, api_key=session.key, max_retries=0)


def _assert_constrained(lab, session, kind: str) -> None:
    """Every call of the session is marked, and the trainer's default leaves its tokens out of the loss."""
    calls = session_calls(lab, session)
    assert calls and all(c.sampling["constraint"] == kind for c in calls)
    masked = prefix_merging(calls)
    assert sum(sum(t.loss_mask) for t in masked) == 0
    assert sum(t.info["constrained"] for t in masked) == len(calls)
    kept = prefix_merging(calls, train_constrained=True)
    assert sum(sum(t.loss_mask) for t in kept) == sum(len(c.output_ids) for c in calls)


def test_chat_parse_returns_schema_valid_objects(lab):
    s = lab.session()
    client = _openai(s)

    def parsed(seed: int) -> Answer | Exception:
        """The SDK's parsed answer, or what its parse raised on the text that came back (off the schema, or cut off
        by max_tokens): a failure of this test's claim, so asserted below rather than raised from the SDK."""
        try:
            reply = client.chat.completions.parse(model="m", messages=[{"role": "user", "content": QUESTION}],
                                                  response_format=Answer, seed=seed, max_tokens=200)
            return reply.choices[0].message.parsed
        except (pydantic.ValidationError, openai.LengthFinishReasonError) as exc:
            return exc

    answers = tries(parsed)
    assert all(isinstance(a, Answer) for a in answers), answers
    _assert_constrained(lab, s, "json_schema")


def test_chat_json_mode_returns_a_json_object_or_runs_out(lab):
    """JSON mode has no schema to size (constraints.any_object): an answer that stops is an object, one that
    runs out of tokens says so, as OpenAI's does."""
    s = lab.session()
    client = _openai(s)
    choices = tries(lambda i: client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": QUESTION}], response_format={"type": "json_object"},
        seed=i, max_tokens=120).choices[0])
    stopped = [c.message.content for c in choices if c.finish_reason == "stop"]
    assert stopped and all(_valid(t, {"type": "object"}) for t in stopped), stopped
    assert all(c.finish_reason == "length" for c in choices if c.finish_reason != "stop")
    _assert_constrained(lab, s, "json_object")


def test_responses_parse_returns_schema_valid_objects(lab):
    s = lab.session(sampling={"seed": 5})  # Responses has no seed: the session forces one, call k gets its own
    client = _openai(s)
    parsed = tries(lambda _: client.responses.parse(model="m", input=QUESTION, text_format=Answer,
                                                     max_output_tokens=200).output_parsed)
    assert all(isinstance(p, Answer) for p in parsed)
    _assert_constrained(lab, s, "json_schema")


@pytest.mark.parametrize("surface", ["responses", "chat"])
def test_the_agents_sdk_gets_its_output_type(lab, surface):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner
    from agents import set_tracing_disabled

    set_tracing_disabled(True)
    s = lab.session(sampling={"seed": 9})
    client = _openai(s, openai.AsyncOpenAI)
    model = OpenAIResponsesModel("m", client) if surface == "responses" else OpenAIChatCompletionsModel("m", client)
    agent = Agent(name="answerer", instructions=SYSTEM_PROMPT, output_type=Answer, model=model,
                  model_settings=ModelSettings(max_tokens=200))

    async def runs():
        return await asyncio.gather(*(Runner.run(agent, QUESTION, max_turns=1) for _ in range(TRIES)))

    assert all(isinstance(run.final_output, Answer) for run in asyncio.run(runs()))


def test_anthropic_structured_output_is_schema_valid(lab):
    s = lab.session(sampling={"seed": 3})
    client = anthropic.Anthropic(base_url=s.anthropic_base_url, api_key=s.key, max_retries=0)
    texts = tries(lambda _: client.messages.create(
        model="m", max_tokens=200, messages=[{"role": "user", "content": QUESTION}],
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}}).content[0].text)
    assert sum(_valid(t) for t in texts) == TRIES, texts
    _assert_constrained(lab, s, "json_schema")


def test_google_response_schema_is_schema_valid(lab):
    s = lab.session()
    client = genai.Client(api_key=s.key, http_options=gtypes.HttpOptions(base_url=s.google_base_url))
    replies = tries(lambda i: client.models.generate_content(
        model="m", contents=QUESTION, config=gtypes.GenerateContentConfig(
            response_mime_type="application/json", response_schema=Answer, seed=i, max_output_tokens=200)))
    assert all(isinstance(r.parsed, Answer) for r in replies), [r.text for r in replies]
    _assert_constrained(lab, s, "json_schema")


def _check_call(name: str, arguments: str | dict, allowed: set[str]) -> None:
    assert name in allowed
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, PARAMS[name])


def test_forced_tool_calls_are_calls_on_chat_and_responses(lab):
    s = lab.session()
    client = _openai(s)
    def one(i: int) -> None:
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": QUESTION}],
            tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}}, seed=i, max_tokens=120)
        (call,) = reply.choices[0].message.tool_calls
        _check_call(call.function.name, call.function.arguments, {"weather"})
        response = client.responses.create(model="m", input=QUESTION, max_output_tokens=120, tool_choice="required",
                                           parallel_tool_calls=False,
                                           tools=[{"type": "function", **t["function"]} for t in TOOLS])
        (call,) = [o for o in response.output if o.type == "function_call"]  # at most one: parallel off
        _check_call(call.name, call.arguments, set(PARAMS))

    tries(one)
    _assert_constrained(lab, s, "tool_call")


def test_forced_tool_calls_are_calls_on_anthropic(lab):
    s = lab.session(sampling={"seed": 1})
    client = anthropic.Anthropic(base_url=s.anthropic_base_url, api_key=s.key, max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    for choice in ({"type": "tool", "name": "clock"}, {"type": "any", "disable_parallel_tool_use": True}):
        def one(_, choice=choice):
            return client.messages.create(model="m", max_tokens=120, tools=tools, tool_choice=choice,
                                          messages=[{"role": "user", "content": QUESTION}])

        for message in tries(one):
            (block,) = [b for b in message.content if b.type == "tool_use"]
            _check_call(block.name, block.input, {choice.get("name")} if "name" in choice else set(PARAMS))


def test_google_allowed_function_names_bound_the_call(lab):
    s = lab.session()
    client = genai.Client(api_key=s.key, http_options=gtypes.HttpOptions(base_url=s.google_base_url))
    declarations = [gtypes.FunctionDeclaration(name=t["function"]["name"], description=t["function"]["description"],
                                               parameters_json_schema=t["function"]["parameters"]) for t in TOOLS]
    allowed = {"weather", "clock"}
    config = functools.partial(gtypes.GenerateContentConfig, tools=[gtypes.Tool(function_declarations=declarations)],
                               max_output_tokens=120, tool_config=gtypes.ToolConfig(
                                   function_calling_config=gtypes.FunctionCallingConfig(
                                       mode="ANY", allowed_function_names=sorted(allowed))))
    for reply in tries(lambda i: client.models.generate_content(model="m", contents=QUESTION, config=config(seed=i))):
        calls = reply.function_calls
        assert calls and len(calls) >= 1, session_calls(lab, s)[-1]
        for call in calls:
            _check_call(call.name, call.args, allowed)


@pytest.mark.parametrize("api", list(SURFACES))
def test_a_schema_keyword_the_grammar_cannot_enforce_is_a_400_naming_it(lab, api):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True}}}
    path, body = SURFACES[api]
    body = dict(body)
    if api == "openai.chat":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        field = "response_format"
    elif api == "openai.responses":
        body["text"] = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
        field = "text.format"
    elif api == "anthropic.messages":
        body["output_config"] = {"format": {"type": "json_schema", "schema": schema}}
        field = "output_config.format"
    else:
        body["generationConfig"] = {"responseMimeType": "application/json", "responseJsonSchema": schema}
        field = "generationConfig.responseJsonSchema"
    s = lab.session()
    r = httpx.post(f"{s.base_url}{path}", json=body, headers={"Authorization": f"Bearer {s.key}",
                                                               "x-api-key": s.key, "x-goog-api-key": s.key})
    assert r.status_code == 400
    assert "'uniqueItems' at 'properties.tags.uniqueItems'" in provider_error(api, r)
    assert provider_error(api, r).startswith(field) or f"(param {field})" in provider_error(api, r)
    assert not session_calls(lab, s)


def test_a_training_session_masks_constrained_calls_unless_configured(lab):
    """The GRPO trainer's builder: constrained tokens out of the loss by default, in with train_constrained."""
    from polar_lab.grpo.config import GRPOConfig
    from polar_lab.grpo.rollouts import trajectory_builder

    assert trajectory_builder(GRPOConfig()) == "prefix_merging"
    keep = trajectory_builder(GRPOConfig(train_constrained=True))
    assert isinstance(keep, functools.partial) and keep.keywords == {"train_constrained": True}
    s = lab.session()
    _openai(s).chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=30,
                                       response_format={"type": "json_object"}, seed=0)
    (traj,) = lab.trajectories(keep, session_ids=[s.id])
    assert sum(traj.loss_mask) == len(session_calls(lab, s)[0].output_ids) > 0


def test_a_structured_output_with_tools_allows_a_call_or_the_document(lab):
    """An agent with an output type and tools (the Agents SDK's common setup): the grammar is the document *or*
    calls in the family's format, so the model can still call a tool (the calculator model always does first)."""
    s = lab.session()
    client = _openai(s)
    replies = [client.chat.completions.create(
        model="m", messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": QUESTION}],
        tools=[CALC_TOOL], seed=i, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}).choices[0]
        for i in range(5)]
    for choice in replies:
        calls = choice.message.tool_calls or []
        assert calls or _valid(choice.message.content), choice
        for call in calls:
            _check_call(call.function.name, call.function.arguments, {"calculator"})
    assert any(c.message.tool_calls for c in replies)
    _assert_constrained(lab, s, "json_schema")
