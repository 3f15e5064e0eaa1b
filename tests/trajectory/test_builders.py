"""Builders on hand-made call records (pure functions; the real-engine version is in tests/integration)."""

from polar_lab.trajectory import per_request, prefix_merging
from polar_lab.types import ModelCall


def call(session, index, prompt, output, *, version=0):
    return ModelCall(call_id=f"{session}-{index}", session_id=session, call_index=index, request_id=str(index),
                     choice_index=0, api="openai.chat", model="m", prompt_ids=prompt, output_ids=output,
                     output_logprobs=[-0.1 * (i + 1) for i in range(len(output))],
                     output_versions=[version] * len(output), policy_version=version, finish_reason="stop",
                     stop_reason=None, sampling={"temperature": 1.0}, request={}, response={}, render={},
                     parse={}, timings={})


# turn 1: prompt [1 2 3] → [4 5]; turn 2: prompt = turn 1 + tool result [6 7] → [8]
TURN1 = call("s", 0, [1, 2, 3], [4, 5])
TURN2 = call("s", 1, [1, 2, 3, 4, 5, 6, 7], [8], version=1)


def test_per_request_is_one_sample_per_call_with_prompt_masked():
    a, b = per_request([TURN1, TURN2])
    assert a.token_ids == [1, 2, 3, 4, 5] and a.loss_mask == [0, 0, 0, 1, 1]
    assert b.token_ids == [1, 2, 3, 4, 5, 6, 7, 8] and b.loss_mask == [0] * 7 + [1]


def test_prefix_merging_joins_turns_and_masks_what_the_model_did_not_sample():
    (chain,) = prefix_merging([TURN2, TURN1])  # order of the input does not matter, call_index does
    assert chain.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert chain.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert chain.behavior_logprobs == [0, 0, 0, -0.1, -0.2, 0, 0, -0.1]
    assert chain.policy_versions == [-1, -1, -1, 0, 0, -1, -1, 1]
    assert chain.call_ids == ["s-0", "s-1"]


def test_a_prompt_that_rewrites_history_starts_a_new_chain_and_reports_the_break():
    rewritten = call("s", 1, [1, 2, 3, 4, 9, 6], [8])  # token 5 changed: the model's output was re-tokenised
    breaks = []
    chains = prefix_merging([TURN1, rewritten], on_break=breaks.append)
    assert [c.token_ids for c in chains] == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 9, 6, 8]]
    (b,) = breaks
    assert (b.call_id, b.closest_chain, b.common_tokens, b.chain_tokens) == ("s-1", 0, 4, 5)


def test_interleaved_subagent_calls_form_their_own_chain_and_the_main_chain_continues():
    sub = call("s", 1, [20, 21], [22])
    main2 = call("s", 2, [1, 2, 3, 4, 5, 6], [7])
    chains = prefix_merging([TURN1, sub, main2])
    assert [c.call_ids for c in chains] == [["s-0", "s-2"], ["s-1"]]


def test_longest_matching_chain_wins():
    short = call("s", 0, [1], [2])
    other = call("s", 1, [1, 2, 3], [4])        # extends chain 0
    fork = call("s", 2, [1, 9], [9])             # new chain
    deeper = call("s", 3, [1, 2, 3, 4, 5], [6])  # extends chain 0 (the longer one), not the fork
    chains = prefix_merging([short, other, fork, deeper])
    assert [c.call_ids for c in chains] == [["s-0", "s-1", "s-3"], ["s-2"]]


def test_sessions_never_merge_with_each_other():
    assert len(prefix_merging([TURN1, call("t", 0, [1, 2, 3, 4, 5, 6], [7])])) == 2
