"""The token alignment view, on trajectories recorded through the real engine."""

import html
import re

import pytest
import torch

from polar_lab.harness import calculator_agent
from polar_lab.harness.multiagent import planner_solver
from polar_lab.trajectory.fidelity import recompute_logprobs
from polar_lab.viz import alignment_html

SPAN = re.compile(r'<span class="tok ([^"]*)" data-i="(\d+)" data-id="(\d+)" data-mask="(\d)" title="[^"]*"[^>]*>(.*?)</span>',
                  re.S)


@pytest.fixture(scope="module")
def calc_trajectory(lab):
    groups = lab.rollout([{"question": "What is 17*3+4?", "answer": 55}], calculator_agent, num_generations=4,
                         evaluator="final_answer", progress=False)
    trajs = [t for g in groups for t in g.trajectories]
    return max(trajs, key=lambda t: len(t.call_ids))  # a run with a tool call, if any made one


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def _spans(page):
    return [(cls.split(), int(i), int(tid), int(mask), html.unescape(text)) for cls, i, tid, mask, text in SPAN.findall(page)]


def test_every_token_appears_once_in_order_with_its_mask(calc_trajectory, tokenizer):
    t = calc_trajectory
    spans = _spans(alignment_html(t, tokenizer))
    assert [s[1] for s in spans] == list(range(len(t.token_ids)))  # each position exactly once, in order
    assert [s[2] for s in spans] == t.token_ids
    assert [s[3] for s in spans] == t.loss_mask
    assert all(("sampled" in s[0]) == bool(m) for s, m in zip(spans, t.loss_mask))
    assert "".join(s[4] for s in spans) == tokenizer.decode(t.token_ids, skip_special_tokens=False)


def test_trainer_logprobs_and_the_largest_gap_are_shown(calc_trajectory, tokenizer, hf_model):
    t = calc_trajectory
    trainer = recompute_logprobs(hf_model, t, t.temperature)
    page = alignment_html(t, tokenizer, trainer_logprobs=trainer, top_k=3)
    gaps = {i: abs(t.behavior_logprobs[i] - trainer[i]) for i, m in enumerate(t.loss_mask) if m}
    worst = max(gaps, key=gaps.get)
    marked = [s[1] for s in _spans(page) if "maxdelta" in s[0]]
    assert worst in marked and len(marked) == 3
    assert f"trainer {trainer[worst]:.5f}" in page and "<table>" in page


def test_roles_are_labelled_and_sampled_tokens_are_the_assistants(calc_trajectory, tokenizer):
    from polar_lab.viz import token_roles

    t = calc_trajectory
    roles = token_roles([tokenizer.decode([i], skip_special_tokens=False) for i in t.token_ids])
    assert {"system", "user", "assistant"} <= set(roles)
    assert all(r == "assistant" for r, m in zip(roles, t.loss_mask) if m)
    page = alignment_html(t, tokenizer)
    assert page.count('class="role role-system"') == 1 and 'class="role role-user"' in page
    if len(t.call_ids) > 1:  # a tool call was made: its result is a labelled tool turn
        assert 'class="role role-tool"' in page


def test_a_chain_break_is_marked_with_its_class(lab, tokenizer):
    groups = lab.rollout([{"question": "What is 6*7?", "answer": 42}], planner_solver, num_generations=1,
                         progress=False)
    session = groups[0].sessions[0]
    chains = sorted([t for t in groups[0].trajectories], key=lambda t: t.chain_index)
    assert len(chains) >= 2
    breaks = lab.chain_breaks(session_ids=[session.id])
    assert set(breaks.session_id) == {session.id}
    kind = breaks[breaks.new_chain == 1]["kind"].iloc[0]
    assert kind == "new_context"
    assert f"break: {kind}" in alignment_html(chains[1], tokenizer, breaks=breaks)
    from polar_lab.viz import show_alignment

    assert f"break: {kind}" in show_alignment(chains[1], lab=lab).data  # the Lab supplies this run's breaks


def test_show_alignment_recomputes_with_the_given_model_and_takes_breaks_from_the_lab(lab, calc_trajectory,
                                                                                      hf_model):
    from polar_lab.viz import show_alignment

    shown = show_alignment(calc_trajectory, lab=lab, model=hf_model)
    spans = _spans(shown.data)
    assert len(spans) == len(calc_trajectory.token_ids)
    assert shown.data.count("· trainer ") == sum(calc_trajectory.loss_mask)  # every sampled token has both numbers
