"""The record of a served call, field by field (proxy/record.py): what training and analysis read back."""

from polar_lab.proxy.canonical import Choice, CompletedCall, ParsedOutput
from polar_lab.proxy.record import model_calls
from polar_lab.types import Generation, Session, derived_seed


def _call(choices, sampling):
    return CompletedCall(
        session=Session(id="sess", key="k"), call_index=12, request_id="req-1", created=100.0, api="anthropic.messages",
        model="tiny", prompt_ids=[5, 6, 7], render={"mode": "exact"}, sampling=sampling, choices=choices,
        timings={"received": 100.0, "render_s": 0.25, "engine_s": 2.0, "paused_s": 0.5})


def _choice(index, ids, versions, *, finish="stop", stop_reason=None, parsed=None, seed=None):
    gen = Generation(output_ids=ids, output_logprobs=[-0.5 * (i + 1) for i in range(len(ids))],
                     output_versions=versions, text="t", finish_reason=finish, stop_reason=stop_reason)
    return Choice(index=index, generation=gen, parsed=parsed or ParsedOutput(content="t"), finish_reason=finish,
                  seed=seed)


def test_each_choice_is_one_record_with_the_calls_shared_fields_and_its_own_tokens():
    parsed = ParsedOutput(content=None, reasoning="r", tool_calls=[{"id": "c", "name": "f", "arguments": "{}"}],
                          errors=["x"])
    choices = [_choice(0, [1, 2, 3], [4, 4, 5], stop_reason="</s>", seed=3),
               _choice(1, [9], [5], finish="tool_calls", parsed=parsed, seed=derived_seed(3, 1))]
    request, response = {"messages": []}, {"id": "msg"}
    first, second = model_calls(_call(choices, {"seed": 3, "temperature": 0.7}), request, response,
                                responded=104.0, engine_version=99)

    for rec, index in ((first, 0), (second, 1)):
        assert rec.call_id == f"sess-0012-{index}" and rec.choice_index == index
        assert (rec.session_id, rec.call_index, rec.request_id) == ("sess", 12, "req-1")
        assert (rec.api, rec.model, rec.prompt_ids, rec.render) == ("anthropic.messages", "tiny", [5, 6, 7],
                                                                    {"mode": "exact"})
        assert rec.request is request and rec.response is response
    assert (first.output_ids, first.output_logprobs, first.output_versions) == ([1, 2, 3], [-0.5, -1.0, -1.5],
                                                                                 [4, 4, 5])
    assert first.policy_version == 4  # the version of its first token, not the engine's now
    assert (first.finish_reason, first.stop_reason) == ("stop", "</s>")
    assert (second.output_ids, second.policy_version, second.finish_reason) == ([9], 5, "tool_calls")
    assert first.parse == {"num_tool_calls": 0, "errors": [], "has_reasoning": False}
    assert second.parse == {"num_tool_calls": 1, "errors": ["x"], "has_reasoning": True}
    # each choice records the seed the engine sampled it with (the service derives choice 1's)
    assert first.sampling == {"seed": 3, "temperature": 0.7}
    assert second.sampling == {"seed": derived_seed(3, 1), "temperature": 0.7} and derived_seed(3, 1) != 3


def test_timings_split_the_calls_wall_time_into_engine_pause_and_proxy():
    (rec,) = model_calls(_call([_choice(0, [1], [0])], {}), {}, {}, responded=104.0, engine_version=0)
    assert rec.timings == {"received": 100.0, "render_s": 0.25, "engine_s": 2.0, "paused_s": 0.5,
                           "responded": 104.0, "total_s": 4.0, "proxy_s": 1.5}
    call = _call([_choice(0, [1], [0])], {})
    del call.timings["paused_s"]  # a call that never waited at a paused proxy
    (rec,) = model_calls(call, {}, {}, responded=103.0, engine_version=0)
    assert rec.timings["total_s"] == 3.0 and rec.timings["proxy_s"] == 1.0


def test_a_choice_without_tokens_carries_the_engines_version_and_unseeded_calls_stay_unseeded():
    choices = [_choice(0, [], [], finish="length"), _choice(1, [], [], finish="abort")]
    recs = model_calls(_call(choices, {"seed": None}), {}, {}, responded=101.0, engine_version=7)
    assert [r.policy_version for r in recs] == [7, 7]
    assert [r.sampling for r in recs] == [{"seed": None}, {"seed": None}]
    assert [r.finish_reason for r in recs] == ["length", "abort"]
