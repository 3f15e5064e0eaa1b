"""Id-spliced continuity (proxy/splice.py) with the fixtures' real tokenizers and chat templates: an echoed turn
goes back into the prompt as the ids the model sampled, wherever the template would have rendered other text."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT
from polar_lab.proxy.formats import FORMATS
from polar_lab.proxy.render import Renderer, Tip
from polar_lab.proxy.splice import Glue, Turn, TurnLedger, edits, pick, probe_glue, sentinel, splice
from tests.timing import returns

QWEN35 = Path("data/models/tiny-calc-qwen35")
FIRST = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What is 12*7+5?"}]
XML_CALL = "<tool_call>\n<function=calculator>\n<parameter=expression>\n12*7+5\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture(scope="module")
def qwen35():
    if not (QWEN35 / "tokenizer.json").exists():
        pytest.skip("run `python scripts/build_tiny_model.py --family qwen35`")
    return Renderer(AutoTokenizer.from_pretrained(QWEN35), FORMATS["qwen3_coder"])


def _sampled(renderer, text: str) -> list[int]:
    """Ids a model may sample for `text`, provably not its canonical tokenisation: one token per character
    outside the added tokens, then eos. Re-tokenising (what splicing must never do) gives other ids."""
    ids = [i for piece in renderer.pieces._split(text) if piece
           for i in ([renderer.pieces._ids[piece]] if piece in renderer.pieces._ids
                     else [t for ch in piece for t in renderer.encode(ch)])]
    ids.append(renderer.tokenizer.eos_token_id)
    assert renderer.encode(renderer.decode(ids)) != ids
    return ids


def _turn(renderer, ids, *, content=None, reasoning=None, calls=(), prefill="", stop=True, call_id="s-0000-0"):
    return Turn(call_id=call_id, opening=renderer.glue().opening + prefill, ids=tuple(ids), text=renderer.decode(ids),
                stop=renderer.decode(ids[-1:]) if stop else "", content=content, reasoning=reasoning,
                tool_calls=tuple(calls))


def _echo(turn, *, with_ids=True, **changes):
    message = {"role": "assistant", "content": turn.content, "tool_calls": [
        {"id": i if with_ids else f"other_{n}", "type": "function", "function": {"name": name, "arguments": args}}
        for n, (i, name, args) in enumerate(turn.tool_calls)]}
    return {**message, **changes}


def test_the_glue_is_probed_from_the_template(tokenizer, qwen35):
    """Header, trailer and what the generation prompt opens: qwen35's opens a thought, tiny-calc's nothing."""
    glue = qwen35.glue()
    assert (glue.header, glue.trailer, glue.opening) == ("<|im_start|>assistant\n", "<|im_end|>\n", "<think>\n")
    assert Renderer(tokenizer).glue().opening == ""
    # a template whose generation prompt does not extend its turn header cannot be spliced
    odd = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    assert Renderer(tokenizer).glue(odd) is None
    assert probe_glue(lambda messages, prompt: 1 / 0) is None  # a template that raises: no splicing, no error


def test_a_thought_the_harness_dropped_stays_in_the_prompt_as_sampled(qwen35):
    """The Qwen3.5 case: the agent echoes the call without its thought. Re-rendered, the prompt loses the thought
    and breaks the chain; spliced, it extends the first call's prompt + sampled ids exactly."""
    first = qwen35.render(FIRST, [CALC_TOOL])
    ids = _sampled(qwen35, "Use the tool.\n</think>\n\n" + XML_CALL)
    turn = _turn(qwen35, ids, reasoning="Use the tool.",
                 calls=[("call_1", "calculator", '{"expression": "12*7+5"}')])
    history = FIRST + [_echo(turn), {"role": "tool", "tool_call_id": "call_1", "content": "89"}]
    chain = first.prompt_ids + ids
    spliced = qwen35.render(history, [CALC_TOOL], splices={2: turn})
    assert spliced.prompt_ids[:len(chain)] == chain and spliced.info["spliced"] == ["s-0000-0"]
    assert spliced.text.endswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n89\n</tool_response><|im_end|>\n"
                                 "<|im_start|>assistant\n<think>\n")
    assert qwen35.decode(spliced.prompt_ids) == spliced.text
    templated = qwen35.render(history, [CALC_TOOL])
    assert templated.prompt_ids[:len(chain)] != chain and "Use the tool." not in templated.text  # negative control
    # a tip over the spliced text gives the same ids as splicing from scratch
    tip = Tip("s-0000-0", first.text + turn.text, chain)
    assert qwen35.render(history, [CALC_TOOL], tips=[tip], splices={2: turn}).prompt_ids == spliced.prompt_ids


def test_hermes_arguments_in_other_spacing_are_spliced_not_reformatted(tokenizer):
    """tiny-calc: the model wrote its JSON arguments without spaces; a harness that parses and re-serialises
    them echoes other text. Spliced, the prompt holds the model's own bytes and ids."""
    r = Renderer(tokenizer)
    first = r.render(FIRST, [CALC_TOOL])
    ids = _sampled(r, '<tool_call>\n{"name":"calculator","arguments":{"expression":"12*7+5"}}\n</tool_call>')
    turn = _turn(r, ids, calls=[("call_2", "calculator", '{"expression":"12*7+5"}')])
    echoed = _echo(turn, tool_calls=[{"id": "call_2", "type": "function", "function": {
        "name": "calculator", "arguments": '{"expression": "12*7+5"}'}}])  # re-serialised by the harness
    assert edits(turn, echoed) is None  # the same call: not an edit
    history = FIRST + [echoed, {"role": "tool", "tool_call_id": "call_2", "content": "89"}]
    spliced = r.render(history, [CALC_TOOL], splices={2: turn})
    assert spliced.prompt_ids[:len(first.prompt_ids) + len(ids)] == first.prompt_ids + ids
    assert '{"expression":"12*7+5"}' in spliced.text and '{"expression": "12*7+5"}' not in spliced.text


def test_a_turn_that_ended_on_a_stop_string_keeps_the_templates_trailer(tokenizer):
    """A stop string is not in the ids: the template's end-of-turn then comes from the template text."""
    r = Renderer(tokenizer)
    ids = _sampled(r, "The answer is 89.")[:-1]  # no eos sampled
    turn = _turn(r, ids, content="The answer is 89.", stop=False)
    history = FIRST + [_echo(turn), {"role": "user", "content": "Thanks"}]
    spliced = r.render(history, [], splices={2: turn})
    assert "The answer is 89.<|im_end|>\n<|im_start|>user\nThanks" in spliced.text
    assert r.decode(spliced.prompt_ids) == spliced.text


def test_a_forced_calls_prefill_is_spliced_back_as_prompt_text(qwen35):
    """The prefill that forced a call was prompt, not sample: it goes back as text before the sampled ids."""
    prefill = qwen35.forced_prefill({"name": "calculator"})
    first = qwen35.render(FIRST, [CALC_TOOL], prefill=prefill)
    ids = _sampled(qwen35, "<parameter=expression>\n1+1\n</parameter>\n</function>\n</tool_call>")
    turn = _turn(qwen35, ids, prefill=prefill, calls=[("call_3", "calculator", '{"expression": "1+1"}')])
    history = FIRST + [_echo(turn), {"role": "tool", "tool_call_id": "call_3", "content": "2"}]
    spliced = qwen35.render(history, [CALC_TOOL], splices={2: turn})
    assert spliced.prompt_ids[:len(first.prompt_ids) + len(ids)] == first.prompt_ids + ids


def test_a_template_that_refuses_the_plain_turn_falls_back_to_rendering_it(tokenizer):
    """A template may insist that tool results follow a turn with calls: splicing then steps aside, the request is
    served as the template renders it, and the render info says why."""
    strict = Renderer(tokenizer).tokenizer.chat_template.replace(
        '{%- elif message.role == "assistant" %}',
        '{%- elif message.role == "assistant" %}{% if not message.tool_calls and not loop.last and '
        'messages[loop.index0 + 1].role == "tool" %}{{ raise_exception("tool results need calls") }}{% endif %}', 1)
    r = Renderer(tokenizer)
    ids = _sampled(r, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>')
    turn = _turn(r, ids, calls=[("call_4", "calculator", '{"expression": "1+1"}')])
    history = FIRST + [_echo(turn), {"role": "tool", "tool_call_id": "call_4", "content": "2"}]
    rendered = r.render(history, [CALC_TOOL], chat_template=strict, splices={2: turn})
    why = rendered.info["splice_failed"]
    assert why.startswith("the chat template refused the turns in plain form: ") and "tool results need calls" in why
    assert "spliced" not in rendered.info
    assert rendered.text == r.render(history, [CALC_TOOL], chat_template=strict).text


def test_history_keys_digest_every_prefix_in_one_pass():
    from polar_lab.proxy.splice import history_keys

    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    keys = history_keys(messages)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert keys[:3] == history_keys(messages[:2]) and history_keys([])[0] == keys[0]
    assert history_keys([{**messages[0], "content": "A"}])[1] != keys[1]


def test_turns_are_found_by_issued_ids_in_any_apis_prefix_else_by_history_else_by_content(qwen35):
    ledger = TurnLedger()
    call = _turn(qwen35, [1, 2], calls=[("call_abc", "calculator", '{"expression": "1"}')], call_id="t1")
    text = _turn(qwen35, [3, 4], content="It is 1.", call_id="t2")
    ledger.add("s", call, history="h1")
    ledger.add("s", text, history="h2")
    anthropic_echo = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "toolu_abc", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1"}'}}]}
    assert ledger.find("s", anthropic_echo, "?") == [call]
    edited = {**anthropic_echo, "tool_calls": [{**anthropic_echo["tool_calls"][0], "function": {
        "name": "calculator", "arguments": '{"expression": "2"}'}}]}
    assert ledger.find("s", edited, "?") == [call]  # by its id alone: neither content nor history fits
    # a client that converts ids by putting its API's prefix over ours (toolu_call_abc): still the issued id
    reprefixed = {**edited, "tool_calls": [{**edited["tool_calls"][0], "id": "toolu_call_abc"}]}
    assert ledger.find("s", reprefixed, "?") == [call]
    assert ledger.find("s", _echo(call, with_ids=False), "?") == [call]  # Google without ids: content, calls
    assert ledger.find("s", {"role": "assistant", "content": "It is 1."}, "?") == [text]
    # an edited text turn has nothing of its own left: it is known by the history it answered
    assert ledger.find("s", {"role": "assistant", "content": "It is 2."}, "h2") == [text]
    assert ledger.find("s", {"role": "assistant", "content": "It is 2."}, "?") == []  # not the proxy's
    assert ledger.find("other-session", anthropic_echo, "h1") == []
    ledger.drop("s")
    assert ledger.find("s", anthropic_echo, "h1") == [] and ledger.nbytes == 0


def test_two_turns_alike_to_the_harness_are_told_apart_by_history_or_not_spliced(qwen35):
    """The same visible reply twice, with different thoughts the harness dropped: each echo is the turn sampled
    after its own history; where history cannot tell (two choices of one request), neither is spliced."""
    ledger = TurnLedger()
    first = _turn(qwen35, [5, 6], content="ok", reasoning="AAA", call_id="t1")
    second = _turn(qwen35, [7, 8], content="ok", reasoning="BBB", call_id="t2")
    ledger.add("s", first, history="h1")
    ledger.add("s", second, history="h2")
    echo = {"role": "assistant", "content": "ok"}
    assert pick(ledger.find("s", echo, "h1"), echo) == (first, None)
    assert pick(ledger.find("s", echo, "h2"), echo) == (second, None)
    assert pick(ledger.find("s", echo, "?"), echo)[0] is None  # content alone: ambiguous
    ledger.add("s", _turn(qwen35, [9], content="ok", call_id="t3-choice-1"), history="h3")
    ledger.add("s", _turn(qwen35, [10], content="ok", call_id="t3-choice-2"), history="h3")
    turn, why = pick(ledger.find("s", echo, "h3"), echo)
    assert turn is None and why.startswith("ambiguous")


def test_a_harness_text_holding_the_sentinel_character_is_not_spliced(tokenizer):
    r = Renderer(tokenizer)
    ids = _sampled(r, "It is 2.")
    turn = _turn(r, ids, content="It is 2.")
    history = FIRST + [_echo(turn), {"role": "user", "content": "<|im_start|>assistant\n\ue000polar-splice-2\ue001"}]
    rendered = r.render(history, [], splices={2: turn})
    assert rendered.info["splice_failed"] == "the chat template rendered an echoed turn in an unexpected place"
    assert "spliced" not in rendered.info and rendered.text == r.render(history, []).text


@pytest.mark.parametrize("change, expected", [
    ({}, None),  # echoed as returned
    ({"reasoning_content": None}, None),  # the thought not echoed: most clients drop it, not an edit
    ({"reasoning_content": "Use the tool."}, None),  # echoed unchanged
    ({"reasoning_content": "I will cheat."}, "reasoning"),
    ({"content": "Sure."}, "content"),
    ({"tool_calls": []}, "tool calls"),
    ({"tool_calls": [{"id": "call_1", "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}}]},
     "tool call calculator"),
    ({"tool_calls": [{"id": "call_1", "function": {"name": "calculator", "arguments": {"expression": "12*7+5"}}}]},
     None),  # arguments as an object (Anthropic, Google) that mean the same
])
def test_what_counts_as_an_edit(qwen35, change, expected):
    turn = _turn(qwen35, [1], reasoning="Use the tool.", calls=[("call_1", "calculator", '{"expression": "12*7+5"}')])
    assert edits(turn, _echo(turn, **change)) == expected


def test_a_closed_sessions_tips_and_turns_are_dropped(scripted_lab):
    import openai

    s = scripted_lab.session()
    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.key, max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    service = scripted_lab.service
    assert service.tips.get(s.id) and service.turns._turns.get(s.id) and service.tips.nbytes > 0
    s.close(reward=1.0)
    assert service.tips.get(s.id) == [] and s.id not in service.turns._turns and service.tips.nbytes == 0


def test_echoes_nested_past_what_json_takes_are_a_4xx_or_served_never_a_500(scripted_lab):
    """History digests and argument comparison meet whatever a harness sends; nesting past orjson's or json's
    limit is not spliced, and the request is answered or refused as under "template"."""
    import httpx

    s = scripted_lab.session()
    url = f"{s.base_url}/s/{s.key}/v1/chat/completions"
    user = [{"role": "user", "content": "hi"}]
    assert httpx.post(url, json={"messages": user}, timeout=30).status_code == 200  # the session has turns now
    deep_string = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": "[" * 50_000}}]}
    r = httpx.post(url, json={"messages": user + [deep_string, {"role": "user", "content": "and?"}]}, timeout=30)
    assert r.status_code < 500, r.text[:300]
    nested: dict = {}
    for _ in range(300):
        nested = {"a": nested}
    r = httpx.post(f"{s.base_url}/s/{s.key}/v1/responses", timeout=30, json={"input": [
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "call_y", "name": "f", "arguments": nested},
        {"type": "function_call_output", "call_id": "call_y", "output": "1"}]})
    assert r.status_code < 500, r.text[:300]


def test_history_digests_hash_only_the_new_messages_and_equal_history_keys(monkeypatch):
    from polar_lab.proxy import splice
    from polar_lab.proxy.splice import HistoryDigests, history_keys

    hashed = []
    dumps = splice.orjson.dumps
    monkeypatch.setattr(splice.orjson, "dumps", lambda m, **kw: hashed.append(m) or dumps(m, **kw))
    conversation = [{"role": "system", "content": "s"}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(6)]
    digests, before = HistoryDigests(), 0
    for n in (2, 4, 6, 7):  # a session's requests, each the previous one plus new messages
        hashed.clear()
        keys = digests.keys("s", conversation[:n])
        assert len(hashed) == n - before  # only the new messages were hashed
        assert keys == history_keys(conversation[:n])
        before = n
    edited = [dict(conversation[0], content="S")] + conversation[1:]
    assert digests.keys("s", edited) == history_keys(edited)  # not a continuation: hashed whole
    assert digests.keys("t", conversation[:3]) == history_keys(conversation[:3])  # another session, its own


def test_echoed_calls_are_read_in_every_shape_a_client_sends():
    """An echoed message's calls, as the splicer compares them: (id, name, arguments as JSON text) from the OpenAI
    shape and the flat one; arguments sent as an object are JSON text; what is not a call is skipped, not the end."""
    from polar_lab.proxy.splice import _message_calls, _same_arguments

    calls = ["not a call", {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
             {"name": "g", "arguments": {"b": 2}}, {"function": {"name": None}}]
    assert _message_calls(calls) == [("call_1", "f", '{"a": 1}'), ("", "g", '{"b": 2}'), ("", "", "null")]
    assert _same_arguments('{"a": 1, "b": 2}', '{"b": 2, "a": 1}')  # key order is not an edit
    assert not _same_arguments('{"a": 1}', '{"a": 2}') and _same_arguments("not json", "not json")


def test_an_echoed_thought_differs_only_by_its_surrounding_newlines(tokenizer):
    r = Renderer(tokenizer)
    turn = _turn(r, _sampled(r, "It is 2."), content="It is 2.", reasoning="Add them.")
    assert edits(turn, _echo(turn, reasoning_content="\nAdd them.\n")) is None  # templates add the newlines
    assert edits(turn, _echo(turn, reasoning_content=" Add them.")) == "reasoning"  # a space is the harness's


def test_a_spliced_prompt_keeps_the_thinking_switch_and_a_sessions_incremental_render(qwen35):
    """enable_thinking=False reaches the glue and the render (the generation prompt closes an empty thought); in a
    session the spliced request renders only its new messages (info["template"]), the same text as from scratch."""
    ids = _sampled(qwen35, "Use the tool.\n</think>\n\n" + XML_CALL)
    turn = _turn(qwen35, ids, reasoning="Use the tool.", calls=[("call_1", "calculator", '{"expression": "12*7+5"}')])
    history = FIRST + [_echo(turn), {"role": "tool", "tool_call_id": "call_1", "content": "89"}]
    closed = qwen35.render(history, [CALC_TOOL], splices={2: turn}, thinking=False)
    assert closed.info["spliced"] == ["s-0000-0"]
    assert closed.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen35.decode(closed.prompt_ids) == closed.text
    qwen35.render(FIRST, [CALC_TOOL], session="s")
    again = qwen35.render(history, [CALC_TOOL], splices={2: turn}, session="s")
    assert again.info["template"] == "2 new messages" and again.info["spliced"] == ["s-0000-0"]
    assert again.text == qwen35.render(history, [CALC_TOOL], splices={2: turn}).text


def test_a_session_template_without_a_plain_assistant_turn_is_not_spliced(tokenizer):
    """A template that writes an assistant turn's content twice has no one place to splice into: the request is
    rendered by the template, and the render info says why."""
    r = Renderer(tokenizer)
    twice = r.tokenizer.chat_template.replace("{{- message.content }}", "{{- message.content + message.content }}")
    assert twice != r.tokenizer.chat_template and r.glue(twice) is None and r.glue() is not None
    ids = _sampled(r, "It is 89.")
    turn = _turn(r, ids, content="It is 89.")
    history = FIRST + [_echo(turn), {"role": "user", "content": "And 2*3?"}]
    rendered = r.render(history, [], chat_template=twice, splices={2: turn})
    assert rendered.info["splice_failed"] == "the chat template has no plain assistant turn to splice into"
    assert rendered.text == r.render(history, [], chat_template=twice).text and "spliced" not in rendered.info


def test_the_turn_ledger_keeps_the_newest_keys_and_sessions_within_its_bounds(tokenizer):
    r = Renderer(tokenizer)
    a, b, c = (_turn(r, ids, content=text, call_id=f"t{n}")
               for n, (ids, text) in enumerate((([6, 6], "A."), ([3, 4, 5], "B."), ([7], "C."))))
    size = {t.call_id: 8 * len(t.ids) + len(t.text) for t in (a, b, c)}
    said = {t.call_id: {"role": "assistant", "content": t.content} for t in (a, b, c)}
    edited = {"role": "assistant", "content": "edited"}
    ledger = TurnLedger(per_session=3, sessions=2, max_bytes=size["t0"] + size["t1"])
    ledger.add("s", a, history="h0")  # two keys: its content and its history
    returns(ledger.add, "s", b, history="h1")  # four keys for room for three: a's oldest, its content, goes
    assert ledger.nbytes == size["t0"] + size["t1"]
    assert ledger.find("s", said["t0"], "?") == [] and ledger.find("s", edited, "h0") == [a]
    assert ledger.find("s", said["t1"], "?") == [b] and ledger.find("s", edited, "h1") == [b]
    ledger.drop("never")  # a session it never held: nothing to give back
    assert ledger.nbytes == size["t0"] + size["t1"]
    returns(ledger.add, "t", c, history="h2")  # two sessions, but over max_bytes: the oldest session goes
    assert ledger.find("s", edited, "h1") == [] and ledger.find("t", said["t2"], "?") == [c]
    assert ledger.nbytes == size["t2"]
    ledger.add("u", a, history="h0")  # within max_bytes and at two sessions: both kept
    assert ledger.find("t", said["t2"], "?") == [c] and ledger.find("u", said["t0"], "?") == [a]
    returns(ledger.add, "v", a, history="h0")  # a third session: the oldest, "t", goes
    assert ledger.find("t", said["t2"], "?") == [] and ledger.find("u", said["t0"], "?") == [a]


def test_history_digests_keep_the_newest_sessions(monkeypatch):
    from polar_lab.proxy import splice
    from polar_lab.proxy.splice import HistoryDigests

    hashed = []
    dumps = splice.orjson.dumps
    monkeypatch.setattr(splice.orjson, "dumps", lambda m, **kw: hashed.append(m) or dumps(m, **kw))
    one, two = [{"role": "user", "content": "a"}], [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    digests = HistoryDigests(sessions=2)
    digests.keys("s", one)
    digests.keys("t", one)
    hashed.clear()
    digests.keys("s", two)  # two sessions held: "s" continues, only its new message is hashed
    assert len(hashed) == 1
    returns(digests.keys, "u", one)  # a third: the oldest, "t", goes; "s" was used since
    hashed.clear()
    digests.keys("s", two + [{"role": "user", "content": "c"}])
    digests.keys("t", two)
    assert len(hashed) == 1 + 2
    digests.drop("t")
    hashed.clear()
    digests.keys("t", two)
    assert len(hashed) == 2


def test_pick_names_the_edit_of_the_turn_it_could_not_use_and_nothing_without_one(tokenizer):
    r = Renderer(tokenizer)
    turn = _turn(r, [1, 2], content="It is 1.", reasoning="Add.")
    assert pick([turn], _echo(turn)) == (turn, None)
    assert pick([turn], _echo(turn, content="It is 2.")) == (None, "content")
    assert pick([], _echo(turn)) == (None, None)
    # a thought echoed with other surrounding newlines is the same thought; with other words it is an edit
    assert edits(turn, _echo(turn, reasoning_content="\nAdd.\n\n")) is None
    assert edits(turn, _echo(turn, reasoning_content="\nAdd more.\n")) == "reasoning"
    assert edits(_turn(r, [1, 2], content="It is 1."), _echo(turn, reasoning_content="X")) == "reasoning"


def test_two_turns_of_one_request_are_each_spliced_in_their_place(tokenizer):
    r = Renderer(tokenizer)
    one, two = _sampled(r, "It is 1."), _sampled(r, "It is 2.")
    first, second = _turn(r, one, content="It is 1.", call_id="c1"), _turn(r, two, content="It is 2.", call_id="c2")
    history = FIRST + [_echo(first), {"role": "user", "content": "And again?"}, _echo(second),
                       {"role": "user", "content": "Thanks."}]
    rendered = r.render(history, [], splices={2: first, 4: second})
    assert rendered.info["spliced"] == ["c1", "c2"]
    ids = rendered.prompt_ids
    at = next(i for i in range(len(ids)) if ids[i:i + len(one)] == one)  # each as sampled, in its own place
    assert any(ids[i:i + len(two)] == two for i in range(at + len(one), len(ids)))
    assert r.decode(ids) == rendered.text == r.render(history, []).text


@pytest.mark.parametrize("ending", ["eos sampled", "stop string", "length"])
def test_a_spliced_prompt_reads_as_the_templates_text_whatever_ended_the_turn(tokenizer, ending):
    """The end-of-turn token the model sampled is the trailer's start, in the ids already; a stop string (not in the
    ids, not the trailer's start) or a cut at max_tokens leave the whole trailer to the template text."""
    import dataclasses

    r = Renderer(tokenizer)
    ids = _sampled(r, "It is 89.")
    turn = _turn(r, ids if ending == "eos sampled" else ids[:-1], content="It is 89.", stop=ending == "eos sampled")
    if ending == "stop string":
        turn = dataclasses.replace(turn, stop="\nObservation:")
    history = FIRST + [_echo(turn), {"role": "user", "content": "Thanks"}]
    spliced = r.render(history, [], splices={2: turn})
    assert spliced.info["spliced"] == ["s-0000-0"] and spliced.text == r.render(history, []).text
    assert r.decode(spliced.prompt_ids) == spliced.text


def test_splice_needs_the_templates_header_before_and_its_trailer_after_each_turn(tokenizer):
    r = Renderer(tokenizer)
    glue, turn = r.glue(), _turn(r, [6, 6], content="A.", stop=False)
    whole = "x" + glue.header + sentinel(0) + glue.trailer + "y"
    assert splice(whole, {0: turn}, glue) == ["x" + glue.header + turn.opening, turn, glue.trailer + "y"]
    assert splice("x" + sentinel(0) + glue.trailer + "y", {0: turn}, glue) is None  # no header before it
    assert splice("x" + glue.header + sentinel(0) + "y", {0: turn}, glue) is None  # no trailer after it


def test_a_thought_is_compared_without_its_surrounding_newlines_only(tokenizer):
    r = Renderer(tokenizer)
    turn = _turn(r, [1, 2], content="It is 1.", reasoning="X marks it. ")
    assert edits(turn, _echo(turn, reasoning_content="\nX marks it. \n")) is None
    assert edits(turn, _echo(turn, reasoning_content="X marks it.")) == "reasoning"  # a space is not a newline


# ---- the glue probe and the splicer on toy templates whose text shows what they were given -----------------------------
def _strict(messages, prompt):
    """A strict template: it refuses a role or key it does not know (as Mistral's and Llama's raise), and reads the
    generation-prompt switch as a bool (`add_generation_prompt is false`)."""
    if not isinstance(prompt, bool):
        raise TypeError(f"add_generation_prompt={prompt!r}")
    out = []
    for m in messages:
        if m.keys() != {"role", "content"} or m["role"] not in ("system", "user", "assistant"):
            raise ValueError(f"a message this template does not know: {m}")
        out.append(f"<{m['role']}>{m['content']}</{m['role']}>")
    return "".join(out) + ("<assistant><think>" if prompt is True else "")


def test_the_glue_is_probed_with_plain_well_formed_messages_and_a_bool_switch():
    """The probe's own messages are ones a strict template takes: a template that refuses them could not be
    spliced at all. Its glue is found, and the opening is what the prompt adds after the header."""
    assert probe_glue(_strict) == Glue(header="<assistant>", trailer="</assistant>", opening="<think>")


def test_turns_rendered_out_of_their_order_are_not_spliced():
    """Each spliced turn has a sentinel of its own: a template that renders the turns in another order (here: the
    later one first) gets no ids put in the wrong place, however alike the turns' places look."""
    glue = Glue(header="<a>", trailer="</a>", opening="")
    first, second = (Turn(call_id=f"t{n}", opening="", ids=(n,), text=str(n), stop="", content=str(n), reasoning=None,
                          tool_calls=()) for n in (1, 2))
    in_order = "<a>" + sentinel(0) + "</a><a>" + sentinel(1) + "</a>"
    assert splice(in_order, {0: first, 1: second}, glue) == ["<a>", first, "</a><a>", second, "</a>"]
    reversed_ = "<a>" + sentinel(1) + "</a><a>" + sentinel(0) + "</a>"
    assert splice(reversed_, {0: first, 1: second}, glue) is None


def test_a_template_with_no_glue_splices_turns_side_by_side():
    """A template that writes messages with nothing around them (a base model's plain concatenation): two turns
    in a row meet at one point, and both are spliced."""
    glue = Glue(header="", trailer="", opening="")
    first, second = (Turn(call_id=f"t{n}", opening="", ids=(n,), text=str(n), stop="", content=str(n), reasoning=None,
                          tool_calls=()) for n in (1, 2))
    assert splice(sentinel(0) + sentinel(1), {0: first, 1: second}, glue) == ["", first, "", second, ""]


def test_a_thought_of_newlines_alone_is_no_thought(tokenizer):
    """An echoed thought that is only newlines says nothing: not an edit of a turn that had no thought."""
    turn = _turn(Renderer(tokenizer), [1, 2], content="It is 1.")
    assert edits(turn, _echo(turn, reasoning_content="\n\n")) is None


def test_messages_holding_values_json_has_no_type_for_are_digested_by_their_text():
    """A message may carry a value orjson cannot write (an SDK's object): it is digested by its text, not refused,
    and two such values differ as their texts do."""
    from polar_lab.proxy.splice import HistoryDigests, history_keys

    class Value:
        def __init__(self, text):
            self.text = text

        def __str__(self):
            return self.text

    a, b = ([{"role": "user", "content": "a", "extra": Value(t)}] for t in ("x", "y"))
    assert history_keys(a) != history_keys(b) and history_keys(a) == history_keys(a)
    digests = HistoryDigests()
    assert digests.keys("s", a) == history_keys(a) and digests.keys("s", a + b) == history_keys(a + b)


def test_the_default_bounds_are_the_documented_ones(tokenizer):
    """HistoryDigests and TurnLedger keep, by default, the newest 4096 sessions and 16384 keys a session."""
    from polar_lab.proxy.splice import HistoryDigests

    digests = HistoryDigests()
    for n in range(4097):
        digests.keys(f"s{n}", [])
    assert len(digests._last) == 4096 and "s0" not in digests._last and "s1" in digests._last
    r = Renderer(tokenizer)
    ledger = TurnLedger()
    turn = _turn(r, [6], content="A.")
    for n in range(4097):
        ledger.add(f"s{n}", turn, history="h")
    assert len(ledger._turns) == 4096 and "s0" not in ledger._turns
    ledger = TurnLedger()
    for n in range(8192):  # two keys each: its content (shared) and its history
        ledger.add("s", turn, history=f"h{n}")
    assert len(ledger._turns["s"]) == 8193 and ledger.find("s", {"content": "A."}, "h0")
    for n in range(8192, 16384):
        ledger.add("s", turn, history=f"h{n}")
    assert len(ledger._turns["s"]) == 16384  # the oldest history key is out
    assert "history:h0" not in ledger._turns["s"] and "history:h1" in ledger._turns["s"]
