"""Token-exact trajectories from real harness runs through the proxy and real vLLM."""

import pytest
import torch

from polar_lab.harness.chain_breakers import (compacting_agent, multi_turn_agent, reserializing_agent,
                                             rewriting_agent, subagent_harness)
from polar_lab.templates import with_empty_think
from polar_lab.trajectory import fidelity, per_request, prefix_merging

QUESTIONS = ["What is 12*(3+4)?", "What is 81-17?", "Compute 5*6*7.", "What is 100+23?", "What is 9*9?"]


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def _calls(lab, session):
    return [c for c in lab.call_records() if c.session_id == session.id]


def test_five_turn_tool_harness_is_one_exact_chain(lab, hf_model):
    s = lab.session(harness="multi_turn")
    lab.run(multi_turn_agent(s, QUESTIONS, turns=5), timeout=300)
    calls = _calls(lab, s)
    assert len(calls) == 5
    assert [c.render["mode"] for c in calls] == ["full"] + ["continued"] * 4
    (chain,) = prefix_merging(calls)  # 100% of calls merge into one chain
    last = calls[-1]
    assert chain.token_ids == last.prompt_ids + last.output_ids
    for c in calls:  # every prompt is the chain so far: the model's own ids, never re-tokenised
        assert chain.token_ids[:len(c.prompt_ids)] == c.prompt_ids
    trained = [i for i, m in enumerate(chain.loss_mask) if m]
    generated = [i for c in calls for i in range(len(c.prompt_ids), len(c.prompt_ids) + len(c.output_ids))]
    assert trained == generated  # loss mask is 1 exactly on generated tokens
    assert [chain.behavior_logprobs[i] for i in trained] == [lp for c in calls for lp in c.output_logprobs]
    report = fidelity([chain], hf_model)
    assert report.mean_abs_diff.iloc[0] <= 1e-3, report


def test_per_request_repeats_the_history_prefix_merging_does_not(lab):
    s = lab.session()
    lab.run(multi_turn_agent(s, QUESTIONS, turns=5), timeout=300)
    calls = _calls(lab, s)
    merged, each = prefix_merging(calls), per_request(calls)
    assert (len(merged), len(each)) == (1, 5)
    assert sum(len(t.token_ids) for t in each) > 2 * len(merged[0].token_ids)
    assert sum(map(sum, (t.loss_mask for t in each))) == sum(merged[0].loss_mask)


def _break_kinds(lab, session):
    breaks = lab.chain_breaks()
    return breaks[breaks.session_id == session.id].kind.tolist()


def _made_tool_call(lab, session):
    return any(c.parse.get("num_tool_calls") for c in _calls(lab, session))


def _until_tool_call(lab, agent, *args, name, tries=6, continuity=None):
    """Run the agent in fresh sessions until the model's forced tool call parsed (the tiny model can botch JSON)."""
    for _ in range(tries):
        s = lab.session(harness=name, continuity=continuity)
        lab.run(agent(s, *args), timeout=300)
        if _made_tool_call(lab, s):
            return s
    pytest.fail(f"no parseable tool call in {tries} sessions")


def test_reserialised_tool_call_json_breaks_the_chain_as_tool_call_rerendered(lab):
    s = _until_tool_call(lab, reserializing_agent, "What is 37*12+5?", name="reserializing", continuity="template")
    assert _break_kinds(lab, s) == ["tool_call_rerendered"]
    assert len(prefix_merging(_calls(lab, s))) == 2


def test_spliced_reserialised_json_keeps_one_chain_with_the_sampled_ids(lab):
    """The default continuity: the re-serialised call is recognised by its id and goes back as sampled."""
    s = _until_tool_call(lab, reserializing_agent, "What is 37*12+5?", name="reserializing-spliced")
    first, second = _calls(lab, s)
    assert second.render["spliced"] == [first.call_id] and _break_kinds(lab, s) == []
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.output_ids)] == first.prompt_ids + first.output_ids


def test_an_edited_echoed_turn_is_not_spliced_and_its_break_says_so(lab):
    async def editing_agent(session, question):  # tells the model it answered something else
        import openai

        client = openai.AsyncOpenAI(base_url=session.openai_base_url, api_key=session.api_key, max_retries=0)
        messages = [{"role": "system", "content": "You are careful."}, {"role": "user", "content": question}]
        reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=16)
        messages += [{"role": "assistant", "content": (reply.choices[0].message.content or "") + " (edited)"},
                     {"role": "user", "content": "Sure?"}]
        await client.chat.completions.create(model="m", messages=messages, max_tokens=16)

    s = lab.session(harness="editing", sampling={"seed": 3})
    lab.run(editing_agent(s, "What is 2+2?"), timeout=300)
    second = _calls(lab, s)[1]
    assert "spliced" not in second.render and second.render["edited"][0]["changed"] == "content"
    assert _break_kinds(lab, s) == ["turn_edited"]


def test_compaction_starts_a_new_chain_classified_as_compaction(lab):
    s = _until_tool_call(lab, compacting_agent, "What is 37*12+5?", "What is 2*21?", name="compacting")
    assert _break_kinds(lab, s) == ["truncation_compaction"]


@pytest.mark.parametrize("how", ["edit", "insert"])
def test_a_rewritten_history_is_its_own_class_not_compaction(lab, how):
    """A harness that edits an earlier user turn in place, or puts a reminder turn ahead of it, loses no turn: the
    break is `history_rewritten`, and the assistant turn the proxy produced still went back as its sampled ids."""
    s = lab.session(harness=f"rewriting-{how}")
    lab.run(rewriting_agent(s, "What is 37*12+5?", "And 2*21?", how=how), timeout=300)
    first, second = _calls(lab, s)
    assert _break_kinds(lab, s) == ["history_rewritten"]
    assert second.render["spliced"] == [first.call_id]


def test_a_subagent_with_its_own_system_prompt_is_a_separate_chain(lab):
    s = _until_tool_call(lab, subagent_harness, "What is 37*12+5?", name="subagent")
    assert _break_kinds(lab, s) == ["new_context"]
    main, sub = prefix_merging(_calls(lab, s))
    assert len(main.call_ids) == 2 and len(sub.call_ids) == 1  # the main agent's chain continued after


def test_a_template_that_drops_think_from_history_breaks_every_turn(lab):
    template = with_empty_think(lab.tokenizer.chat_template)
    s = lab.session(chat_template=template, harness="empty_think", continuity="template")
    lab.run(multi_turn_agent(s, QUESTIONS, turns=3), timeout=300)
    assert _break_kinds(lab, s) == ["thinking_stripped"] * 2
    spliced = lab.session(chat_template=template, harness="empty_think-spliced")  # the default keeps one chain
    lab.run(multi_turn_agent(spliced, QUESTIONS, turns=3), timeout=300)
    assert _break_kinds(lab, spliced) == [] and len(prefix_merging(_calls(lab, spliced))) == 1
    report = lab.drift_report()
    row = report[(report.harness == "empty_think") & (report.kind == "thinking_stripped")]
    assert row["count"].iloc[0] == 2 and "<think>" in row.chain_context.iloc[0]
