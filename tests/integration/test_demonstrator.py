"""The demonstrator (harness/demonstrator.py) drives the four unmodified CLIs through their own tools.

Behind the proxy it is a ScriptedEngine's reply function (no vLLM: it is the scripted policy whose recorded sessions
train the tiny-agent fixture, not an acceptance test of the engine). The CLIs, the sandbox, the proxy's four APIs,
the parsers, the chain builder and the evaluators are the real ones: each arithmetic session runs the CLI's shell
tool and answers with what it printed; each SWE session reads, edits, tests and finishes, and the instance's
held-out tests pass on what the CLI changed.
"""

import pytest
from transformers import AutoTokenizer

from polar_lab.harness import presets
from polar_lab.harness.demonstrator import Demonstrator, Fix, Mistakes, read_prompt, wrong
from polar_lab.tasks import load_tasks
from tests.conftest import agent_installed, session_calls

QWEN35 = "data/models/tiny-calc-qwen35-hybrid"
CLIS = ["codex", "claude_code", "qwen_code", "pi"]
SHELL = {"codex": "exec_command", "claude_code": "Bash", "qwen_code": "run_shell_command", "pi": "bash"}
pytestmark = pytest.mark.ci_required  # the CLIs are installed by `make agents` in CI



@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(QWEN35)


def _lab(tokenizer, tmp_path, policy, name):
    from polar_lab import Lab
    from polar_lab.engine import ScriptedEngine

    engine = ScriptedEngine(tokenizer, policy, model_path=QWEN35, max_model_len=32768)
    return Lab(QWEN35, port=0, engine=engine, runs_dir=str(tmp_path), run_name=name)


def _called_tools(calls) -> list[str]:
    return [t["name"] for c in calls for t in (c.parse.get("tool_calls") or [])]


@pytest.mark.parametrize("cli", CLIS)
def test_arithmetic_through_each_cli_shell_tool_is_two_calls_in_one_chain_and_answers_what_it_printed(
        cli, tokenizer, tmp_path):
    if not agent_installed(cli):
        pytest.skip("run `make agents`")
    tasks = load_tasks("data/tasks/calc_test.jsonl", 2)
    with _lab(tokenizer, tmp_path, Demonstrator(tasks), cli) as lab:
        groups = lab.rollout(tasks, getattr(presets, cli)(), num_generations=1, evaluator="final_answer", seed=3,
                             deadline_s=180, progress=False)
        for g in groups:
            (s,) = g.sessions
            assert s.status == "closed" and s.reward == 1.0, s.info
            calls = session_calls(lab, s)
            assert len(calls) == 2 and len(g.trajectories) == 1
            command = calls[0].response  # the call the CLI ran: its own shell tool, the task's expression
            assert g.task["expression"] in str(command) and SHELL[cli] in str(command)
            # the second request carries what the command printed, in the CLI's own shape
            assert str(g.task["answer"]) in tokenizer.decode(calls[1].prompt_ids[len(calls[0].prompt_ids):])


@pytest.mark.parametrize("cli", CLIS)
def test_a_swe_instance_is_read_edited_tested_and_fixed_in_five_calls(cli, tokenizer, tmp_path):
    """Claude Code echoes its Edit call back with `replace_all: false` added: the history no longer holds what was
    sampled, so the chain breaks there, and the proxy says why (`render.edited`)."""
    if not agent_installed(cli):
        pytest.skip("run `make agents`")
    task = load_tasks("data/tasks/swe_mini.jsonl", 1)
    with _lab(tokenizer, tmp_path, Demonstrator(task, key="prompt"), cli) as lab:
        (g,) = lab.rollout(task, getattr(presets, cli)(task_field="prompt", workspace="files"), num_generations=1,
                           evaluator="repo_tests", seed=5, deadline_s=180, progress=False)
        (s,) = g.sessions
        assert s.status == "closed" and s.reward == 1.0, s.info
        calls = session_calls(lab, s)
        assert len(calls) == 5
        edited = [e for c in calls for e in c.render.get("edited", [])]
        if cli == "claude_code":
            assert len(g.trajectories) == 2 and {e["changed"] for e in edited} == {"tool call Edit"}
        else:
            assert len(g.trajectories) == 1 and not edited


def test_reading_a_prompt_finds_tools_task_and_results():
    text = ('<|im_start|>system\n# Tools\n<tools>\n{"type": "function", "function": {"name": "exec_command", '
            '"parameters": {"properties": {"cmd": {}}}}}\n</tools><|im_end|>\n<|im_start|>user\n<environment_context>'
            '<cwd>/tmp/w</cwd></environment_context><|im_end|>\n<|im_start|>user\nCompute 2+3.<|im_end|>\n'
            '<|im_start|>assistant\n<think>\nRun it.\n</think>\n\n<tool_call>\n<function=exec_command>\n</function>\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nOutput:\n5\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n<think>\n')
    prompt = read_prompt(text)
    assert prompt.tools == {"exec_command": ["cmd"]} and prompt.cwd == "/tmp/w"
    assert prompt.task_text == "Compute 2+3." and prompt.results == ["Output:\n5"]
    reply = Demonstrator([{"question": "Compute 2+3.", "expression": "2+3", "answer": 5}])(text, _spec(0))
    assert reply.endswith("The answer is 5.")


def _spec(seed):
    from polar_lab.types import SamplingSpec

    return SamplingSpec(max_tokens=64, seed=seed)


def test_mistakes_come_at_their_rates_from_each_call_seed():
    task = {"question": "Compute 12+30.", "expression": "12+30", "answer": 42}
    first = ('<|im_start|>system\n<tools>\n{"type": "function", "function": {"name": "bash", "parameters": '
             '{"properties": {"command": {}}}}}\n</tools><|im_end|>\n<|im_start|>user\nCompute 12+30.<|im_end|>\n'
             '<|im_start|>assistant\n<think>\n')
    second = first + 'x</think>\n<tool_call>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n42\n' \
                     '</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n'
    never, always = Demonstrator([task]), Demonstrator([task], mistakes=Mistakes(direct=1.0, wrong_final=1.0))
    assert "<function=bash>" in never(first, _spec(1)) and never(second, _spec(1)).endswith("The answer is 42.")
    assert "<tool_call>" not in always(first, _spec(1)) and not always(second, _spec(1)).endswith("is 42.")
    half = Demonstrator([task], mistakes=Mistakes(wrong_final=0.5))
    answers = [half(second, _spec(seed)) for seed in range(200)]
    assert answers == [half(second, _spec(seed)) for seed in range(200)]  # each seed decides the same way again
    assert 60 < sum(a.endswith("The answer is 42.") for a in answers) < 140


def test_a_swe_fix_is_read_from_the_reference_patch_and_a_wrong_edit_differs_from_it():
    (task,) = load_tasks("data/tasks/swe_mini.jsonl", 1)
    fix = Fix.of(task)
    assert fix.path in task["files"] and fix.old in task["files"][fix.path] and fix.old != fix.new
    import random

    bad = wrong(fix, random.Random(0))
    assert bad.old == fix.old and bad.new != fix.new
