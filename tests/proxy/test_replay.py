"""proxy/replay.py's Script on hand-made records: what is answered from the record, where a branch leaves it."""

from polar_lab.proxy.replay import Script, generation
from polar_lab.types import ModelCall


def _call(index, prompt, output, choice=0, finish="stop"):
    return ModelCall(call_id=f"c{index}.{choice}", session_id="src", call_index=index, request_id=f"r{index}",
                     choice_index=choice, api="openai.chat", model="m", prompt_ids=prompt, output_ids=output,
                     output_logprobs=[-0.5] * len(output), output_versions=[3] * len(output), policy_version=3,
                     finish_reason=finish, stop_reason=None, sampling={}, request={}, response={}, render={},
                     parse={}, timings={})


RECORD = [_call(0, [1, 2], [7, 8], finish="tool_calls"), _call(1, [1, 2, 7, 8, 9], [5]),
          _call(2, [1, 2, 7, 8, 9, 5, 6], [4])]


class Digits:
    """A tokenizer stand-in: each id is its own digit."""

    def decode(self, ids, **options):
        return " ".join(map(str, ids))


DIGITS = Digits()


def test_calls_before_turn_k_come_from_the_record_and_the_rest_go_live():
    script = Script(RECORD, live_from=2)
    (first,) = script.answer(0, [1, 2], 1)
    assert first is RECORD[0]
    assert script.answer(1, [1, 2, 7, 8, 9], 1)[0].output_ids == [5]
    assert script.answer(2, [1, 2, 7, 8, 9, 5, 6], 1) is None  # turn 3: live
    assert script.report() == {"source": "src", "live_from": 2, "replayed": 2, "exact": True, "diverged": None}


def test_a_branch_that_leaves_the_record_stays_live_even_where_a_later_prompt_matches_again():
    script = Script(RECORD, live_from=3)
    assert script.answer(0, [1, 2], 1) is not None
    assert script.answer(1, [1, 2, 7, 8, 0], 1) is None
    assert script.answer(2, [1, 2, 7, 8, 9, 5, 6], 1) is None
    assert script.report()["diverged"] == {"call_index": 1, "token": 4, "recorded": 9, "sent": 0}
    assert not script.report()["exact"]


def test_another_number_of_choices_is_a_divergence_of_the_request_not_of_its_prompt():
    script = Script(RECORD, live_from=3)
    assert script.answer(0, [1, 2], 2) is None
    assert script.report()["diverged"] == {"call_index": 0, "token": -1, "recorded": None, "sent": None}


def test_a_recorded_choice_answers_as_the_engine_did_with_its_alternatives_and_cache_hit():
    """The Generation a replayed call is answered with: what a response is built from, as the engine returned it
    (finish "stop" for a tool call: the parser, not the engine, says "tool_calls")."""
    call = _call(0, [1, 2], [7, 8], finish="tool_calls")
    call.cached_tokens, call.top_logprobs = 2, [[(7, -0.1), (6, -2.5)], [(8, -0.2)]]
    gen = generation(call, DIGITS)
    assert (gen.output_ids, gen.output_versions, gen.text, gen.finish_reason) == ([7, 8], [3, 3], "7 8", "stop")
    assert gen.cached_tokens == 2 and gen.top_logprobs == [{7: -0.1, 6: -2.5}, {8: -0.2}]
