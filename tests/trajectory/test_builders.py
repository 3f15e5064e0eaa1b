"""Builders on hand-made call records (pure functions; the real-engine version is in tests/integration)."""

import dataclasses

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


def _with(record, **fields):
    for name, value in fields.items():
        setattr(record, name, value)
    return record


def test_every_trajectory_knows_its_session_chain_and_sampling_temperature():
    hot = _with(call("s", 0, [1, 2], [3]), sampling={"temperature": 0.7})
    unset = _with(call("t", 0, [1], [2]), sampling={})  # a harness that sent none: the engine's 1.0
    merged = prefix_merging([hot, unset])  # chains are numbered within their session
    assert [(t.session_id, t.chain_index, t.temperature) for t in merged] == [("s", 0, 0.7), ("t", 0, 1.0)]
    one_each = per_request([hot, unset])  # one sample per call, numbered in order
    assert [(t.session_id, t.chain_index, t.temperature) for t in one_each] == [("s", 0, 0.7), ("t", 1, 1.0)]


def test_a_call_cut_by_max_tokens_marks_its_chain_truncated():
    cut = _with(call("s", 1, [1, 2, 3, 4, 5, 6, 7], [8]), finish_reason="length")
    (chain,) = prefix_merging([TURN1, cut])
    assert chain.truncated is True
    (whole,) = prefix_merging([TURN1, TURN2])
    assert whole.truncated is False


def test_a_turn_cut_off_by_its_caller_is_kept_but_never_trained():
    """A stream whose client disconnected is recorded with finish_reason "abort": its tokens stay in the chain
    (what was sampled), with loss 0 — it is no completed turn."""
    aborted = _with(call("s", 1, [1, 2, 3, 4, 5, 6, 7], [8, 9]), finish_reason="abort")
    for build in (prefix_merging, per_request):
        last = build([TURN1, aborted])[-1]
        assert last.token_ids[-2:] == [8, 9] and last.loss_mask[-2:] == [0, 0] and last.info["aborted"] == 1
    (whole,) = prefix_merging([TURN1, TURN2])
    assert whole.loss_mask[-1] == 1 and "aborted" not in whole.info


def test_a_chain_sampled_at_two_temperatures_says_so():
    cooler = _with(call("s", 1, [1, 2, 3, 4, 5, 6, 7], [8]), sampling={"temperature": 0.5})
    (mixed,) = prefix_merging([TURN1, cooler])
    assert mixed.temperature == 1.0 and mixed.info.get("mixed_temperatures") is True
    (same,) = prefix_merging([TURN1, TURN2])
    assert "mixed_temperatures" not in same.info


def test_a_prompt_equal_to_the_whole_chain_extends_it():
    again = call("s", 1, [1, 2, 3, 4, 5], [6])  # the template added nothing after the model's turn
    (chain,) = prefix_merging([TURN1, again])
    assert chain.token_ids == [1, 2, 3, 4, 5, 6] and chain.loss_mask == [0, 0, 0, 1, 1, 1]


def test_a_break_names_its_session_the_new_chain_and_the_closest_chain():
    first = call("s", 0, [1, 2, 3], [4, 5])  # chain 0: 1 2 3 4 5
    other = call("s", 1, [1, 9], [9])  # chain 1: 1 9 9 (shares 1 token with chain 0)
    third = call("s", 2, [1, 9, 8, 7], [3])  # shares 2 tokens with chain 1, 1 with chain 0: a break
    breaks = []
    chains = prefix_merging([first, other, third], on_break=breaks.append)
    assert len(chains) == 3
    closest = breaks[-1]
    assert (closest.session_id, closest.call_id, closest.new_chain) == ("s", "s-2", 2)
    assert (closest.closest_chain, closest.common_tokens, closest.chain_tokens) == (1, 2, 3)


def test_calls_without_a_temperature_are_all_at_the_engines_default():
    first = _with(call("s", 0, [1, 2, 3], [4, 5]), sampling={})
    second = _with(call("s", 1, [1, 2, 3, 4, 5, 6], [7]), sampling={})
    (chain,) = prefix_merging([first, second])
    assert chain.temperature == 1.0 and "mixed_temperatures" not in chain.info


def test_a_prompt_asked_again_after_its_answer_was_delivered_is_a_chain_of_its_own():
    short = call("s", 0, [1], [2, 3])  # chain 0: 1 2 3, delivered
    again = call("s", 1, [1], [2, 3, 4])  # the same prompt sampled again, further (best-of-n by hand): chain 1
    later = call("s", 2, [1, 2, 3, 4, 5], [6])  # both chains are prefixes of it: the longer one wins
    chains = prefix_merging([short, again, later])
    assert [c.token_ids for c in chains] == [[1, 2, 3], [1, 2, 3, 4, 5, 6]] and not chains[0].info


def test_a_retry_orphan_is_recorded_but_neither_trained_nor_splitting_the_chain():
    """A harness whose call timed out asks again with the same messages: the first answer never reached it."""
    orphan = dataclasses.replace(call("s", 1, [1, 2, 3, 4, 5, 6, 7], [8]), delivered=False)  # its caller had gone
    retry = call("s", 2, [1, 2, 3, 4, 5, 6, 7], [9])  # the same prompt again
    turn3 = call("s", 3, [1, 2, 3, 4, 5, 6, 7, 9, 10], [11])  # the harness carries on from the retry's answer
    breaks = []
    (chain,) = prefix_merging([TURN1, orphan, retry, turn3], on_break=breaks.append)
    assert chain.token_ids == [1, 2, 3, 4, 5, 6, 7, 9, 10, 11] and breaks == []
    assert chain.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1]  # turn 1's tokens once, the orphan's 8 nowhere
    assert chain.call_ids == ["s-0", "s-2", "s-3"] and chain.info["retry_orphans"] == ["s-1"]
    assert len(chain.behavior_logprobs) == len(chain.policy_versions) == len(chain.token_ids)


def test_per_request_trains_a_retry_orphan_nowhere_either_and_names_it_on_the_retry():
    """The same record as above, one sample per call: the orphan's answer (8) is in no sample, as in prefix_merging;
    an undelivered answer that nobody asked for again stays (it is the run's last word), and so do siblings."""
    orphan = dataclasses.replace(call("s", 1, [1, 2, 3, 4, 5, 6, 7], [8]), delivered=False)
    retry = call("s", 2, [1, 2, 3, 4, 5, 6, 7], [9])
    last = dataclasses.replace(call("s", 3, [1, 2, 3, 4, 5, 6, 7, 9, 10], [11]), delivered=False)
    samples = per_request([TURN1, orphan, retry, last])
    assert [t.call_ids for t in samples] == [["s-0"], ["s-2"], ["s-3"]]
    assert [t.chain_index for t in samples] == [0, 1, 2]
    assert samples[1].info["retry_orphans"] == ["s-1"] and 8 not in samples[1].token_ids
    cut = dataclasses.replace(orphan, finish_reason="abort", delivered=True)  # cut off mid-stream, then asked again
    assert [t.call_ids for t in per_request([TURN1, cut, retry])] == [["s-0"], ["s-2"]]
    first = dataclasses.replace(call("s", 0, [1, 2], [3]), delivered=False)
    second = dataclasses.replace(call("s", 0, [1, 2], [4]), call_id="s-0-1", choice_index=1, delivered=False)
    assert len(per_request([first, second])) == 2  # two choices of one call: siblings


def test_two_choices_of_one_call_are_siblings_not_a_retry():
    first = dataclasses.replace(call("s", 0, [1, 2], [3]), delivered=False)
    second = dataclasses.replace(call("s", 0, [1, 2], [4]), call_id="s-0-1", choice_index=1, delivered=False)
    chains = prefix_merging([first, second])
    assert [c.token_ids for c in chains] == [[1, 2, 3], [1, 2, 4]] and not chains[0].info


def test_a_break_with_two_equally_close_chains_names_the_first():
    breaks = []
    prefix_merging([call("s", 0, [1, 2], [3]), call("s", 1, [1, 5], [6]), call("s", 2, [1, 7], [8])],
                   on_break=breaks.append)
    assert [(b.new_chain, b.closest_chain, b.common_tokens) for b in breaks] == [(1, 0, 1), (2, 0, 1)]


def test_a_record_whose_per_token_lists_disagree_is_refused_by_name():
    import pytest

    short = _with(call("s", 1, [1, 2, 3, 4, 5, 6, 7], [8, 9]), output_logprobs=[-0.1])  # one logprob missing
    for build in (per_request, prefix_merging):
        with pytest.raises(ValueError, match="call s-1: 2 output ids but 1 logprobs"):
            build([TURN1, short])


def test_a_turn_cut_off_mid_stream_then_asked_again_is_a_retry_orphan():
    cut = dataclasses.replace(call("s", 1, [1, 2, 3, 4, 5, 6, 7], [8]), finish_reason="abort")
    retry = call("s", 2, [1, 2, 3, 4, 5, 6, 7], [9])
    (chain,) = prefix_merging([TURN1, cut, retry])
    assert chain.token_ids == [1, 2, 3, 4, 5, 6, 7, 9] and chain.info["retry_orphans"] == ["s-1"]
