"""Real agent programs, unmodified, against a Lab session."""

import time

import pytest

from polar_lab.tasks import load_tasks
from polar_lab.harness.presets import (claude_code, codex, gemini_cli, mini_swe_agent,
                                      openai_agents_calculator, opencode, pi, qwen_code)
from tests.conftest import agent_installed, processes_of, session_calls


pytestmark = pytest.mark.ci_required  # every agent preset is an ecosystem promise: CI installs them all (make agents)


def test_mini_swe_agent_runs_and_every_call_is_recorded_with_exact_ids(lab, tokenizer):
    assert lab.sandbox_level == "isolated"  # it runs isolated, unmodified
    (g,) = lab.rollout(load_tasks("data/tasks/calc_test.jsonl", 1), mini_swe_agent(step_limit=3),
                       num_generations=1, deadline_s=300, progress=False)
    (s,) = g.sessions
    assert s.status == "closed", s.info.get("error")
    calls = session_calls(lab, s)
    assert 1 <= len(calls) <= 3  # its step limit
    for c in calls:
        assert c.api == "openai.chat" and c.request["tools"][0]["function"]["name"] == "bash"
        assert len(c.output_logprobs) == len(c.output_ids) > 0
    assert sum(len(t.call_ids) for t in g.trajectories) == len(calls)  # every call is in some chain


def _run_agent(lab, harness):
    assert lab.sandbox_level == "isolated" and harness.sandbox is None  # the agent runs isolated, unmodified
    (g,) = lab.rollout(load_tasks("data/tasks/calc_test.jsonl", 1), harness, num_generations=1, deadline_s=300,
                       progress=False)
    (s,) = g.sessions
    assert s.status == "closed", s.info.get("error")
    calls = session_calls(lab, s)
    assert calls and all(len(c.output_logprobs) == len(c.output_ids) > 0 for c in calls)
    assert sum(len(t.call_ids) for t in g.trajectories) == len(calls)
    return calls


def _rerun_exactly(lab, harness, calls):
    """The recorded run again, every call answered from the record (issue 44): the agent, isolated, sees its workdir
    at the same path run after run, so its prompts match the record id for id and the engine never steps."""
    steps = lab.engine.steps
    replayed = lab.replay(calls[0].session_id, until_turn=len(calls) + 1, harness=harness, branches=1)
    assert replayed.exact == 1, replayed.frame().to_dict("records")
    assert lab.engine.steps == steps


@pytest.mark.skipif(not agent_installed("claude"), reason="run `make agents` (npm) to install Claude Code")
def test_claude_code_runs_unmodified_over_the_anthropic_surface_and_reruns_exactly_from_its_record(lab):
    calls = _run_agent(lab, claude_code())
    assert all(c.api == "anthropic.messages" and c.request["stream"] is True for c in calls)
    assert {t["name"] for t in calls[0].request["tools"]} >= {"Bash", "Read"}
    _rerun_exactly(lab, claude_code(), calls)


@pytest.mark.skipif(not agent_installed("codex"), reason="run `make agents` (npm) to install Codex CLI")
def test_codex_runs_unmodified_over_the_responses_surface_and_reruns_exactly_from_its_record(lab):
    calls = _run_agent(lab, codex())
    assert all(c.api == "openai.responses" and c.request["stream"] is True for c in calls)
    assert any(m.get("role") == "developer" for m in calls[0].request["input"])
    _rerun_exactly(lab, codex(), calls)


TOKENS = 384


@pytest.mark.parametrize("name, preset", [("claude", claude_code), ("codex", codex)])
def test_claude_code_and_codex_are_sent_tokens_while_they_are_sampled(lab, name, preset):
    """Issue 17's acceptance for the CLI agents: every call forced to 384 tokens (ignore_eos), each of their streamed
    calls had its first sampled text handed to the connection before half the call's time (the record's
    `first_delta_s`; what the program does with it cannot be seen from outside — the SDK tests in
    test_streaming.py show a client receives what the proxy hands over, as it is handed over). A proxy that replays
    a finished generation hands it over after all of it. Longer than the SDK tests' 64 tokens: these agents' prompts
    are thousands of tokens (Codex's first token ~0.9 s here), and the claim is about the generation after it."""
    if not agent_installed(name):
        pytest.skip("run `make agents` (npm) to install the CLI agents")
    (g,) = lab.rollout(load_tasks("data/tasks/calc_test.jsonl", 1), preset(), num_generations=1, deadline_s=120,
                       progress=False, sampling={"ignore_eos": True, "max_tokens": TOKENS})
    calls = session_calls(lab, g.sessions[0])
    assert calls, g.sessions[0].info
    for c in calls:
        assert c.request["stream"] is True and len(c.output_ids) == TOKENS
        first, total = c.timings["first_delta_s"], c.timings["total_s"]
        assert first < 0.5 * total, f"{c.call_id}: first text handed over at {first:.3f} s of {total:.3f} s"


def test_openai_agents_sdk_runs_unmodified_over_the_responses_surface(lab):
    tasks = load_tasks("data/tasks/calc_test.jsonl", 2)
    groups = lab.rollout(tasks, openai_agents_calculator, num_generations=2, deadline_s=300, progress=False)
    sessions = [s for g in groups for s in g.sessions]
    calls = [c for s in sessions for c in session_calls(lab, s)]
    assert calls and all(c.api == "openai.responses" for c in calls)
    # the SDK finishes (or, rarely, stops at its turn limit); either way every call is recorded with exact ids
    assert all(s.status == "closed" or "MaxTurnsExceeded" in s.info.get("error", "") for s in sessions), \
        [s.info.get("error") for s in sessions]
    assert any(s.status == "closed" for s in sessions)
    assert all(len(c.output_logprobs) == len(c.output_ids) > 0 for c in calls)
    tool_results = [i for c in calls for i in c.request["input"] if i.get("type") == "function_call_output"]
    assert tool_results, "the SDK never executed a calculator call"


@pytest.mark.skipif(not agent_installed("claude"), reason="run `make agents` (npm) to install Claude Code")
def test_an_agent_prompt_over_the_context_gets_the_provider_error_not_a_hang(lab):
    huge = {"id": "huge", "question": "add these numbers: " + "7 " * 40000}  # > 32k tokens
    t0 = time.monotonic()
    (g,) = lab.rollout([huge], claude_code(), num_generations=1, deadline_s=120, progress=False)
    (s,) = g.sessions
    assert s.status == "error" and time.monotonic() - t0 < 100  # Claude Code gave up on the 400, no hang
    assert "maximum context length" in s.info["output"], s.info["output"][-2000:]  # the proxy's 400, as relayed
    assert session_calls(lab, s) == []  # nothing was generated, nothing recorded


# the paper's other harnesses (Table 1: Qwen Code, Pi) and two more, each with the API it speaks
NEW_PRESETS = [("qwen", qwen_code, "openai.chat"), ("gemini", gemini_cli, "google.generate_content"),
               ("pi", pi, "openai.chat"), ("opencode", opencode, "openai.chat")]


def _agent_processes():
    """Live processes of this worker's sandbox users: the agents it ran, and nothing another worker runs beside it
    (every npm agent shares one install folder, so a command-line match would see the other worker's CLIs)."""
    from polar_lab.sandbox import isolation

    return processes_of(isolation.pool())


@pytest.mark.parametrize("binary, preset, api", NEW_PRESETS, ids=[p[0] for p in NEW_PRESETS])
def test_each_new_preset_runs_unmodified_and_its_process_tree_is_gone_after_the_deadline(lab, binary, preset, api):
    if not agent_installed(binary):
        pytest.skip(f"run `make agents` (npm) to install {binary}")
    assert lab.sandbox_level == "isolated"  # its runs are this worker's sandbox users' processes, seen below
    calls = _run_agent(lab, preset())
    assert {c.api for c in calls} == {api} and len(calls[0].prompt_ids) > 1000  # its own prompt, tools and all
    (g,) = lab.rollout(load_tasks("data/tasks/calc_test.jsonl", 1), preset(), num_generations=1, deadline_s=0.5,
                       progress=False)
    assert g.sessions[0].status == "timeout"  # cut off mid-run ...
    deadline = time.monotonic() + 10  # SIGKILLed processes leave the table once the kernel has torn them down
    while _agent_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _agent_processes() == []  # ... and nothing of it is left
