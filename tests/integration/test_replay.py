"""Replay and branch a recorded run (issue 44) on the shared real engine: every API surface, streamed or not, gets its
recorded answer again without the engine, byte for byte; branches share the recorded prefix's ids exactly and go live
at turn k; a harness that sends another prompt is caught at the first differing token."""

import asyncio

import httpx
import orjson
import pytest

from polar_lab.harness import calculator_agent
from polar_lab.harness.calculator import CALC_TOOL, run_calculator
from polar_lab.tasks import load_tasks

QUESTION = "What is 12+30?"


def openai_chat(s, stream):
    import openai

    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key, max_retries=0)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}], stream=stream)
    return "".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream else r.choices[0].message.content


def openai_responses(s, stream):
    import openai

    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key, max_retries=0)
    r = client.responses.create(model="m", input=QUESTION, stream=stream)
    return "".join(e.delta for e in r if e.type == "response.output_text.delta") if stream else r.output_text


def anthropic_messages(s, stream):
    import anthropic

    client = anthropic.Anthropic(base_url=s.anthropic_base_url, api_key=s.key, max_retries=0)
    r = client.messages.create(model="m", max_tokens=16, stream=stream, messages=[{"role": "user", "content": QUESTION}])
    if stream:
        return "".join(e.delta.text for e in r if e.type == "content_block_delta" and e.delta.type == "text_delta")
    return "".join(b.text for b in r.content if b.type == "text")


def google_genai(s, stream):
    from google import genai
    from google.genai import types

    client = genai.Client(api_key=s.key, http_options=types.HttpOptions(base_url=s.google_base_url))
    if stream:
        return "".join(c.text or "" for c in client.models.generate_content_stream(model="m", contents=QUESTION))
    return client.models.generate_content(model="m", contents=QUESTION).text


SDKS = {"openai.chat": openai_chat, "openai.responses": openai_responses, "anthropic.messages": anthropic_messages,
        "google.generate_content": google_genai}


def calls_of(lab, session_id):
    return sorted(lab.call_records([session_id]), key=lambda c: (c.call_index, c.choice_index))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_every_surface_gets_its_recorded_answer_again_without_the_engine(lab, stream):
    seen: dict[str, str] = {}

    async def harness(session, task):
        seen[session.id] = await asyncio.to_thread(SDKS[task["api"]], session, stream)

    for api in SDKS:
        (group,) = lab.rollout([{"api": api}], harness, num_generations=1, sampling={"max_tokens": 16},
                               progress=False)
        (source,) = group.sessions
        steps = lab.engine.steps
        replayed = lab.replay(source.id, until_turn=2, harness=harness, branches=1)
        assert lab.engine.steps == steps, api  # nothing was sampled: the engine never stepped
        (branch,) = replayed.group.sessions
        assert seen[branch.id] == seen[source.id] and seen[source.id], api  # what the harness read, streamed or not
        (old,), (new,) = calls_of(lab, source.id), calls_of(lab, branch.id)
        assert (new.replayed, old.replayed, new.api) == (True, False, api)
        assert new.timings["engine_s"] == 0.0 and new.prompt_ids == old.prompt_ids
        assert (new.output_ids, new.output_logprobs, new.output_versions) == \
            (old.output_ids, old.output_logprobs, old.output_versions)
        assert orjson.dumps(new.response) == orjson.dumps(old.response), api  # its id and timestamp too
        assert replayed.exact == 1 and branch.info["replay"]["replayed"] == 1


TOOL = CALC_TOOL["function"]
RAW = {  # one request per API with the calculator tool, as each API's wire format writes it
    "openai.chat": ("/v1/chat/completions", {"model": "m", "max_tokens": 48, "tools": [CALC_TOOL],
                                             "messages": [{"role": "user", "content": QUESTION}]}),
    "openai.responses": ("/v1/responses", {"model": "m", "max_output_tokens": 48, "input": QUESTION,
                                           "tools": [{"type": "function", **TOOL}]}),
    "anthropic.messages": ("/v1/messages", {
        "model": "m", "max_tokens": 48, "messages": [{"role": "user", "content": QUESTION}],
        "tools": [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}]}),
    "google.generate_content": ("/v1beta/models/m:generateContent", {
        "contents": [{"role": "user", "parts": [{"text": QUESTION}]}], "generationConfig": {"maxOutputTokens": 48},
        "tools": [{"functionDeclarations": [TOOL]}]}),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_replayed_answer_is_the_recorded_bytes_tool_call_ids_and_all(lab, stream):
    """Answers with a tool call, read off the wire: a whole answer reaches the branch as the source's body byte for
    byte; a streamed one carries the source's text and tool-call ids (in one delta), and its record is the source's."""
    bodies: dict[str, bytes] = {}

    async def harness(session, task):
        path, body = RAW[task["api"]]
        if stream:
            path, body = (path.replace(":generateContent", ":streamGenerateContent?alt=sse"), body) \
                if "google" in task["api"] else (path, {**body, "stream": True})
        async with httpx.AsyncClient(timeout=60) as client:
            response = await client.post(session.openai_base_url.removesuffix("/v1") + path, json=body)
        bodies[session.id] = response.raise_for_status().content

    called = 0
    for api in RAW:
        (group,) = lab.rollout([{"api": api}], harness, num_generations=1, seed=7, progress=False)
        (source,) = group.sessions
        (branch,) = lab.replay(source.id, until_turn=2, harness=harness, branches=1).group.sessions
        (old,), (new,) = calls_of(lab, source.id), calls_of(lab, branch.id)
        assert new.replayed and orjson.dumps(new.response) == orjson.dumps(old.response), api
        if not stream:
            assert bodies[branch.id] == bodies[source.id], api
        called += old.parse["num_tool_calls"] > 0
    assert called >= 2, "the tiny model called the tool in fewer than two APIs: the ids were not put to the test"


def _two_turn_session(lab):
    """A recorded calculator run with a tool call and an answer (a seeded search over the first tasks)."""
    for i, task in enumerate(load_tasks("data/tasks/calc_train.jsonl")[:20]):
        (group,) = lab.rollout([task], calculator_agent, num_generations=1, seed=100 + i,
                               sampling={"temperature": 1.0, "max_tokens": 64}, progress=False)
        calls = calls_of(lab, group.sessions[0].id)
        if len(calls) >= 2:
            return group.sessions[0], calls
    pytest.fail("no two-turn calculator run in 20 seeded tries")


def test_branches_share_the_recorded_prefix_exactly_and_sample_live_from_turn_k(lab):
    source, recorded = _two_turn_session(lab)
    replayed = lab.replay(source.id, until_turn=2, harness=calculator_agent, branches=3, evaluator="final_answer")
    assert replayed.exact == 3 and len(replayed.frame()) == 3
    for branch in replayed.group.sessions:
        first, second, *_ = calls_of(lab, branch.id)
        assert first.replayed and first.output_ids == recorded[0].output_ids  # turn 1 from the record
        assert not second.replayed and second.timings["engine_s"] > 0  # turn 2 sampled live
        assert second.prompt_ids == recorded[1].prompt_ids  # the recorded prefix, id for id, up to turn 2's prompt
    chains = lab.trajectories(session_ids=[s.id for s in replayed.group.sessions])
    prefix = recorded[1].prompt_ids
    assert chains and all(c.token_ids[:len(prefix)] == prefix for c in chains)
    assert all(s.reward is not None for s in replayed.group.sessions)  # scored like any rollout: per-turn credit


def test_a_harness_that_sends_another_prompt_is_caught_at_the_first_differing_token_and_goes_live(
        lab, monkeypatch):
    """The branch's calculator answers with a digit more than the recorded one: turn 1 still replays, turn 2's prompt
    differs where the tool's answer does, and that call is sampled live."""
    source, recorded = _two_turn_session(lab)
    import polar_lab.harness.calculator as calculator

    monkeypatch.setattr(calculator, "run_calculator", lambda arguments: run_calculator(arguments) + "0")
    replayed = lab.replay(source.id, until_turn=3, harness=calculator_agent, branches=1)
    (branch,) = replayed.group.sessions
    first, second, *_ = calls_of(lab, branch.id)
    assert first.replayed and not second.replayed
    expected = next(i for i, (a, b) in enumerate(zip(recorded[1].prompt_ids, second.prompt_ids)) if a != b)
    assert branch.info["replay"]["diverged"] == {"call_index": 1, "token": expected,
                                                 "recorded": recorded[1].prompt_ids[expected],
                                                 "sent": second.prompt_ids[expected]}
    row = replayed.frame().iloc[0]
    assert (row["exact"], row["diverged_call"], row["diverged_token"]) == (False, 1, expected)


def test_replay_refuses_what_it_cannot_replay(lab):
    from polar_lab.errors import ConfigError

    with pytest.raises(ConfigError, match="until_turn"):
        lab.replay("x", until_turn=0, harness=calculator_agent)
    with pytest.raises(ConfigError, match="no recorded session 'nope'"):
        lab.replay("nope", until_turn=2, harness=calculator_agent)
