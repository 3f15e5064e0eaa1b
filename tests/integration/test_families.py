"""A second model family on the real engine (issue 16): tiny-calc-qwen35 writes a short thought, then an XML
tool call (the Qwen3.5 / Qwen3-Coder format). vLLM's own parsers read it; the calculator agent (an ordinary
OpenAI-SDK loop) gets structured calls and the thought in `reasoning_content`; the engine's logprobs are the
trainer's. Every API surface through its SDK, and the other families: tests/integration/test_continuity.py."""

from pathlib import Path

import pytest

from polar_lab.harness.calculator import calculator_agent
from polar_lab.tasks import load_tasks
from polar_lab.trajectory.fidelity import fidelity

MODEL = Path("data/models/tiny-calc-qwen35")
pytestmark = [pytest.mark.ci_required,
              pytest.mark.skipif(not (MODEL / "model.safetensors").exists(),
                                 reason="run `python scripts/build_tiny_model.py --family qwen35`")]


@pytest.fixture(scope="module")
def qwen35_lab(engines, tmp_path_factory):
    with engines.lab(MODEL, runs_dir=str(tmp_path_factory.mktemp("runs")), run_name="qwen35") as lab:
        yield lab


def test_auto_picks_vllms_qwen3_xml_and_reasoning_parsers(qwen35_lab):
    assert qwen35_lab.parsers == {"tool_parser": "qwen3_coder", "reasoning_parser": "qwen3"}


def test_xml_calls_and_thoughts_come_back_structured_with_the_trainers_logprobs(qwen35_lab):
    from transformers import AutoModelForCausalLM

    tasks = load_tasks("data/tasks/calc_test.jsonl", 10)
    groups = qwen35_lab.rollout(tasks, calculator_agent, num_generations=2, evaluator="final_answer", seed=7,
                                progress=False)
    assert all(s.status == "closed" and s.reward in (0.0, 1.0) for g in groups for s in g.sessions)
    first = [c for c in qwen35_lab.reader.call_records() if c.call_index == 0]
    assert len(first) == 20
    messages = [c.response["choices"][0]["message"] for c in first]
    called = [m for m in messages if m.get("tool_calls")]
    assert len(called) >= 16, [c.response for c in first]  # >= 80% structured calls, never markup as text
    assert all("<tool_call>" not in (m.get("content") or "") for m in called)
    assert all(m["tool_calls"][0]["function"]["name"] == "calculator" for m in called)
    assert sum(bool(m.get("reasoning_content")) for m in messages) >= 16  # the thought in its own field
    assert all("</think>" not in (m.get("content") or "") for m in messages)

    # the agent echoes its calls without the thought; spliced back as sampled, every session stays one chain
    # (tests/integration/test_continuity.py shows the template's breaks)
    assert qwen35_lab.chain_breaks().empty and all(len(g.trajectories) == len(g.sessions) for g in groups)

    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype="float32").eval()
    chains = [t for g in groups for t in g.trajectories]
    report = fidelity(chains, model)
    assert report["mean_abs_diff"].max() <= 1e-4, report  # fp32 on CPU: the sampler's numbers are the trainer's


def test_grpo_through_xml_calls_and_thoughts_raises_held_out_accuracy(qwen35_lab, tmp_path):
    """The families' learning acceptance, near the size docs/benchmarks.md measured over seeds ("Learning, the suite's
    size": 8 tasks x 8 runs a step, 50 held-out tasks; after 3 steps +0.22 to +0.34 on this fixture): one step more,
    for margin above the +0.15 asserted."""
    from polar_lab import GRPOConfig, GRPOTrainer

    config = GRPOConfig(learning_rate=5e-4, tasks_per_step=8, eval_limit=50, seed=1, output_dir=str(tmp_path))
    start = qwen35_lab.policy_version  # the suite's shared engine: versions before this test are other tests'
    with GRPOTrainer(qwen35_lab, config) as trainer:
        before = trainer.evaluate(progress=False)["eval_reward"]
        trainer.train(4, progress=False)
        after = trainer.evaluate(progress=False)["eval_reward"]
    assert after - before >= 0.15, f"held-out accuracy {before:.2f} -> {after:.2f} after 4 steps"
    first = [c for c in qwen35_lab.reader.call_records() if c.policy_version > start and c.call_index == 0]
    assert sum(c.parse["num_tool_calls"] > 0 for c in first) >= 0.8 * len(first) > 0  # still XML calls vLLM reads


def test_a_thinking_budget_ends_the_thought_where_it_runs_out(qwen35_lab):
    """Google's thinkingBudget (Anthropic's budget_tokens alike) through vLLM's thinking_token_budget: after N thought
    tokens the end marker is forced; a training session's forced sampling turns the budget off (issue 18)."""
    import httpx

    body = {"contents": [{"role": "user", "parts": [{"text": "What is 12*7+5?"}]}],
            "generationConfig": {"maxOutputTokens": 48, "seed": 1, "thinkingConfig": {"thinkingBudget": 2}}}
    close = qwen35_lab.tokenizer.convert_tokens_to_ids("</think>")
    for sampling, budget in (({}, 2), ({"thinking_budget": None}, None)):
        s = qwen35_lab.session(sampling=sampling)
        r = httpx.post(f"{s.base_url}/s/{s.key}/v1beta/models/m:generateContent", json=body, timeout=60)
        assert r.status_code == 200, r.text[:300]
        (call,) = [c for c in qwen35_lab.reader.call_records() if c.session_id == s.id]
        assert call.sampling["thinking_budget"] == budget
        if budget is not None:  # the prompt opened the thought: at most 2 thought tokens, then the close
            assert close in call.output_ids[:budget + 1], qwen35_lab.tokenizer.decode(call.output_ids)
        else:
            assert call.sampling["overridden"]["thinking_budget"] == 2
