"""Rendering only the new messages (proxy/history.py): for every family fixture, a corpus of conversations (not the
probe's own) sent request by request renders to the same text and ids as rendering each request whole — and the
incremental path is really taken where the template was found to allow it."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from polar_lab.errors import RequestError
from polar_lab.proxy.formats import resolve_parsers, tool_format
from polar_lab.proxy.history import TemplateHistory
from polar_lab.proxy.render import Renderer

MODELS = Path(__file__).resolve().parents[2] / "data" / "models"
FIXTURES = ["tiny-calc", "tiny-calc-qwen35", "tiny-calc-llama3", "tiny-calc-mistral"]
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the notes.", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "write", "parameters": {"type": "object", "properties": {}}}}]


def _call(i, name="search", args='{"query": "ab\\"c", "limit": 3}'):
    return {"id": f"t{i}", "type": "function", "function": {"name": name, "arguments": args}}


SYSTEM = {"role": "system", "content": "You keep notes.\nBe exact."}
CORPUS = {  # name -> messages; requests end after each user message and each last tool result
    "tools and parallel calls": [
        SYSTEM, {"role": "user", "content": "Find the notes on é and 中文."},
        {"role": "assistant", "content": None, "tool_calls": [_call(0)]},
        {"role": "tool", "tool_call_id": "t0", "content": "[1, 2]"},
        {"role": "assistant", "content": "Two notes."}, {"role": "user", "content": "Write both, then search."},
        {"role": "assistant", "content": "Doing both.", "tool_calls": [_call(1, "write", "{}"), _call(2)]},
        {"role": "tool", "tool_call_id": "t1", "content": "ok"}, {"role": "tool", "tool_call_id": "t2", "content": "[]"},
        {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks.\n\n  Bye."}],
    "no system": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c " * 50},
        {"role": "assistant", "content": "d\n"}, {"role": "user", "content": "e"}],
    "a second system prompt": [
        SYSTEM, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "system", "content": "Now be brief."}, {"role": "user", "content": "c"}],
    "thoughts": [
        SYSTEM, {"role": "user", "content": "a"},
        {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [_call(0)]},
        {"role": "tool", "tool_call_id": "t0", "content": "x"},
        {"role": "assistant", "content": "x it is.", "reasoning_content": "Found."}, {"role": "user", "content": "b"}],
    "a thought in the text": [
        SYSTEM, {"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nhm\n</think>\n\nb"},
        {"role": "user", "content": "c"}],
}


def _ends(messages):
    return [n for n in range(1, len(messages) + 1) if messages[n - 1]["role"] in ("user", "tool")
            and (n == len(messages) or messages[n]["role"] != "tool")]


@pytest.fixture(scope="module", params=FIXTURES)
def renderer_pair(request):
    path = MODELS / request.param
    if not (path / "tokenizer_config.json").exists():
        pytest.skip(f"no fixture {request.param}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    fmt = tool_format(resolve_parsers("auto", "auto", tokenizer.chat_template)[0], tokenizer.chat_template)
    return request.param, Renderer(tokenizer, fmt), Renderer(tokenizer, fmt)


@pytest.mark.parametrize("thinking", [None, False])
@pytest.mark.parametrize("name", list(CORPUS))
def test_a_session_rendered_request_by_request_is_byte_identical_to_rendering_each_whole(renderer_pair, name,
                                                                                          thinking):
    fixture, incremental, whole = renderer_pair
    messages, session = CORPUS[name], f"{name}-{thinking}"
    for tools in ([], TOOLS):
        used = 0
        for n in _ends(messages):
            try:
                expected = whole.render(messages[:n], tools, thinking=thinking)
            except RequestError:
                pytest.skip(f"{fixture}'s template refuses this conversation")
            got = incremental.render(messages[:n], tools, thinking=thinking, session=session)
            assert (got.text, got.prompt_ids) == (expected.text, expected.prompt_ids), (fixture, name, n)
            used += "template" in got.info
        stable = incremental.history.checked(None, thinking, "thought" in name) is not None
        assert used == (len(_ends(messages)) - 1 if stable else 0), (fixture, name, used)
        incremental.history.drop(session)


@pytest.mark.parametrize("name", list(CORPUS))
def test_requests_that_end_anywhere_still_render_as_whole(renderer_pair, name):
    """Harnesses do not always end a request after a user message: after an assistant message (a prefill), or in
    the middle of a group of tool results (one result sent as soon as it is ready). Every prefix, in order."""
    fixture, incremental, whole = renderer_pair
    messages, session = CORPUS[name], f"anywhere-{name}"
    for n in range(1, len(messages) + 1):
        try:
            expected = whole.render(messages[:n], TOOLS)
        except RequestError:
            continue  # this template refuses that prefix (a strict role order)
        got = incremental.render(messages[:n], TOOLS, session=session)
        assert (got.text, got.prompt_ids) == (expected.text, expected.prompt_ids), (fixture, name, n)


def test_the_fixtures_that_render_incrementally_are_the_ones_expected(renderer_pair):
    """Qwen3.5's template hides the thoughts of turns before the last question: with thoughts in the conversation it
    is rendered whole; the other fixtures render every conversation incrementally."""
    fixture, renderer, _ = renderer_pair
    history = renderer.history
    assert history.checked(None, None, False) is not None
    assert (history.checked(None, None, True) is None) == (fixture == "tiny-calc-qwen35")


def test_a_request_that_does_not_continue_the_last_is_rendered_whole_and_the_history_is_bounded():
    calls = []

    def template(messages, tools, chat_template, *, generation_prompt=True, thinking=None):
        calls.append(len(messages))
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<gen>" if generation_prompt else "")

    history = TemplateHistory(template, sessions=2)
    conversation = [{"role": r, "content": c} for r, c in zip("user assistant user assistant user".split(), "abcde")]
    assert history.render("s", conversation[:3], [], None, None) == "<user>a<assistant>b<user>c<gen>"
    calls.clear()
    assert history.render("s", conversation, [], None, None) == "<user>a<assistant>b<user>c<assistant>d<user>e<gen>"
    assert max(calls) == 3  # the first message standing in for the history, and the two new ones, not all five
    edited = [{"role": "user", "content": "A"}] + conversation[1:]
    calls.clear()
    assert history.render("s", edited, [], None, None).startswith("<user>A") and calls == [5]
    for other in ("t", "u"):
        history.render(other, conversation[:1], [], None, None)
    calls.clear()
    history.render("s", edited + [{"role": "assistant", "content": "f"}, {"role": "user", "content": "g"}], [], None, None)
    assert calls == [7]  # "s" was the oldest of three sessions with room for two: rendered whole


def test_a_retried_request_renders_as_before_and_a_dropped_session_gives_back_its_characters():
    def template(messages, tools, chat_template, *, generation_prompt=True, thinking=None):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<gen>" if generation_prompt else "")

    history = TemplateHistory(template)
    ends_on_a_result = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "tool", "content": "c"}]
    history.render("t", ends_on_a_result[:1], [], None, None)
    base = history.chars
    first = history.render("s", ends_on_a_result, [], None, None)
    assert history.chars > base
    assert history.render("s", ends_on_a_result, [], None, None) == first  # the same request again (a retry)
    history.drop("s")
    assert history.chars == base
    history.drop("s")  # twice: nothing more to give back
    assert history.chars == base
    history.drop("t")
    assert history.chars == 0


# ---- the history's own logic, on toy templates whose text shows every input they get --------------------------------
# A real template hides most mistakes of the incremental path (a wrong argument often renders the same text); these
# show each input — the template's name, the tools, the thinking switch, each message's neighbour — so a mistake in
# what reaches a render changes the text. Each named template breaks incremental rendering in one way, or not at all.
# They are strict, as real templates are: a malformed message or call, a result that answers no call, a call of a
# tool not given, a generation-prompt switch that is not a bool are refused.

# each question (tool result) shows the first one's text, as a task reminder: not incremental, and only a corpus whose
# questions (results) differ shows it — a stand-in's first question is a later one
QUOTES_FIRST = {"first-question": "user", "first-result": "tool"}
# which messages show their neighbour under a template that does so only with thoughts, or only with the thinking
# switch not off: the first message alone stands in for the history only where none does
NEIGHBOURS = {"thought-after-role": lambda m, thinking: bool(m.get("reasoning_content")),
              "thinking-after-role": lambda m, thinking: thinking is not False}


def toy(messages, tools, chat_template, *, generation_prompt=True, thinking=None):
    if not isinstance(generation_prompt, bool):  # read strictly, as `add_generation_prompt is false` does
        raise RequestError(f"generation_prompt={generation_prompt!r}")
    name = chat_template or "plain"
    declared = {t["function"]["name"] for t in tools}
    system = messages[0]["role"] == "system"
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    nothink = "/nothink" if thinking is False else ""
    out, unanswered = [f"[{name}|{','.join(sorted(declared))}|{thinking}]"], None
    for i, m in enumerate(messages):
        if m["role"] not in ("system", "user", "assistant", "tool") or "content" not in m:
            raise RequestError(f"a malformed message: {m}")  # a strict template
        tag = m["role"] + ("+sys" if system and m["role"] == "user" else "")  # the first message read by later ones
        if name == "after-role" or NEIGHBOURS.get(name, lambda m, thinking: False)(m, thinking):
            tag += f"<{messages[i - 1]['role'] if i else ''}"  # the message's neighbour: kept by the two-message stand-in
        if name == "alternating" and i and m["role"] == messages[i - 1]["role"] == "user":  # Gemma's, Mistral's
            raise RequestError("two user messages in a row")  # no stand-in may put two in a row where none were
        if name == "lone-message" and len(messages) == 1:  # a conversation of one message rendered apart
            tag += "+only"  # not incremental: a history of one message is extended at the probe's first end
        if name == "final-user" and i == len(messages) - 1 and m["role"] == "user":  # the question being asked
            tag += "!"  # not incremental: probed only where requests end (after a user or tool message), it shows
        if m["role"] == "tool":  # strict, as Mistral's: a result answers a call of the assistant turn before it
            if unanswered is not None:  # (a stand-in may open with a result: its call is in the history)
                if m.get("tool_call_id") not in unanswered:
                    raise RequestError(f"a result that answers no call: {m}")
                unanswered.remove(m["tool_call_id"])
            tag += f"#{m.get('tool_call_id')}"
        calls = m.get("tool_calls") or []
        if m["role"] == "assistant":
            unanswered = [_strict_call(c, declared) for c in calls]
        thought = m.get("reasoning_content")
        if thought and not _hidden(name, messages, i, last_user):  # not incremental once there are thoughts
            out.append(f"<think>{thought}</think>")
        text = m["content"] or ""
        if name == "hide-text-thoughts" and i < last_user and text.startswith("<think>"):
            text = text.partition("</think>")[2].lstrip("\n")  # a thought the model wrote in its reply, hidden
        called = "".join(f"{c['function']['name']}{'' if c['function']['name'] in declared else '?'}"
                         f"({c['function']['arguments']})#{c['id']}" for c in calls)
        if QUOTES_FIRST.get(name) == m["role"]:
            text = next(q["content"] for q in messages if q["role"] == m["role"]) + "/" + text
        out.append(f"<{tag}>{text}{called}")
    if generation_prompt:  # "prompt-by-role": not a fixed suffix, so not incremental
        out.append(f"<gen{nothink}{':' + messages[-1]['role'] if name == 'prompt-by-role' else ''}>")
    return "".join(out)


def _strict_call(call, declared):
    """A call's id, for a template that reads every key of it and refuses a tool it was not given."""
    if call.get("type") != "function" or not {"id", "function"} <= call.keys() \
            or not {"name", "arguments"} <= call["function"].keys():
        raise RequestError(f"a malformed call: {call}")
    if declared and call["function"]["name"] not in declared:
        raise RequestError(f"a call of a tool not given: {call}")
    return call["id"]


def _hidden(name, messages, i, last_user):
    """Whether the toy template hides message i's thought (its field): a thought hidden once the conversation goes on
    past it makes a template not incremental for conversations with thoughts."""
    calls = bool(messages[i].get("tool_calls"))
    answered = any(m["role"] == "assistant" and not m.get("tool_calls") for m in messages[i + 1:])
    later = any(m["role"] == "assistant" for m in messages[i + 1:])
    return (name == "hide-thoughts" and i < last_user  # Qwen3's: every turn's thought before the last question
            or name == "latest-answer-thought" and not calls and later  # an answer's, once another turn follows
            or name == "hide-call-thoughts" and calls and answered)  # gpt-oss's: a call's, once an answer follows


# name → what the probe must find, without and with thoughts: (generation prompt, first message alone stands in) or None
TOYS = {"plain": (("<gen/nothink>", True),) * 2, "after-role": (("<gen/nothink>", False),) * 2,
        "final-user": (None, None), "hide-thoughts": (("<gen/nothink>", True), None), "prompt-by-role": (None, None),
        "latest-answer-thought": (("<gen/nothink>", True), None), "hide-call-thoughts": (("<gen/nothink>", True), None),
        "hide-text-thoughts": (("<gen/nothink>", True), None), "first-question": (None, None),
        "first-result": (None, None), "lone-message": (None, None),
        "thought-after-role": (("<gen/nothink>", True), ("<gen/nothink>", False)),
        "thinking-after-role": (("<gen/nothink>", True),) * 2, "alternating": (("<gen/nothink>", True),) * 2}


@pytest.mark.parametrize("name", list(TOYS))
def test_the_probe_finds_each_toy_template_incremental_or_not_as_its_rendering_allows(name):
    history = TemplateHistory(toy)
    assert (history.checked(name, False, False), history.checked(name, False, True)) == TOYS[name]


@pytest.mark.parametrize("corpus", ["tools and parallel calls", "thoughts", "a second system prompt"])
@pytest.mark.parametrize("name", list(TOYS))
def test_a_session_under_each_toy_template_renders_as_whole_and_incrementally_where_the_probe_allows(name, corpus):
    """Byte-identical to rendering each request whole; the new messages alone rendered wherever the probe said
    the template allows it; and with the first message standing in, one render per request (its text is kept)."""
    messages, calls = CORPUS[corpus], []

    def counted(*args, **kwargs):
        calls.append(1)
        return toy(*args, **kwargs)

    history = TemplateHistory(counted)
    allowed = TOYS[name][any(m.get("reasoning_content") for m in messages)]
    history.checked(name, False, True), history.checked(name, False, False)  # probed up front: not counted below
    ends = _ends(messages)
    for i, n in enumerate(ends):
        info, calls[:] = {}, []
        got = history.render("s", messages[:n], TOOLS, name, False, info)
        assert got == toy(messages[:n], TOOLS, name, thinking=False), (name, n)
        assert ("template" in info) == (i > 0 and allowed is not None), (name, n, info)
        if i > 1 and allowed is not None:  # from the third request on, what the history keeps is reused
            assert len(calls) == (1 if allowed[1] else 2), (name, n)
    assert (history.chars > 0) == (allowed is not None)  # a session rendered whole to its end keeps nothing


def test_a_session_that_stops_being_incremental_gives_back_its_characters():
    """Under a template that hides earlier thoughts, a session is incremental until a thought arrives; then its
    kept text is dropped, not left to grow stale."""
    messages = CORPUS["thoughts"]
    history = TemplateHistory(toy)
    history.render("s", messages[:2], [], "hide-thoughts", None)
    assert history.chars > 0
    history.render("s", messages[:4], [], "hide-thoughts", None)  # a thought came with the tool call
    assert history.chars == 0


def test_the_history_keeps_its_bounds_exactly_and_counts_what_it_keeps():
    conversation = [{"role": "user", "content": "a"}]
    texts = {s: "[plain||None]<user>a" for s in "pqr"}  # what each session keeps: its text without the prompt
    size = len(texts["p"])
    history = TemplateHistory(toy, sessions=2, max_chars=2 * size)
    for s in "pq":
        history.render(s, conversation, [], None, None)
    assert (list(history._previous), history.chars) == (["p", "q"], 2 * size)  # at both bounds: nothing evicted
    history.render("r", conversation, [], None, None)
    assert (list(history._previous), history.chars) == (["q", "r"], 2 * size)  # the oldest out, its characters too
    history = TemplateHistory(toy, max_chars=2 * size - 1)
    for s in "pqr":
        history.render(s, conversation, [], None, None)
    assert (list(history._previous), history.chars) == (["r"], size)  # characters bound the history alone


def test_the_checked_templates_are_bounded_oldest_out():
    history = TemplateHistory(toy)
    names = [f"plain-{i}" for i in range(65)]
    for name in names:
        assert history.checked(name, None, False) == ("<gen>", True)
    assert list(history._checked) == [(name, None, False) for name in names[1:]]  # 64 kept: the first one is out


def test_the_history_keeps_the_newest_4096_sessions_by_default():
    history = TemplateHistory(toy)
    for n in range(4097):
        history.render(f"s{n}", [{"role": "user", "content": "a"}], [], None, None)
    assert len(history._previous) == 4096 and "s0" not in history._previous and "s1" in history._previous


def test_a_session_whose_stand_in_changes_when_a_thought_arrives_renders_as_whole():
    """Under a template where a message with a thought shows its neighbour, the first message alone stands in until
    a thought comes; then the two-message stand-in does, and the text kept for the first message alone is not
    reused for it."""
    messages = [SYSTEM, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "reasoning_content": "e"},
                {"role": "user", "content": "f"}]
    history = TemplateHistory(toy)
    for n in (2, 4, 6):
        info = {}
        got = history.render("s", messages[:n], [], "thought-after-role", False, info)
        assert got == toy(messages[:n], [], "thought-after-role", thinking=False), n
        assert ("template" in info) == (n > 2), n
    assert history._previous["s"].head == toy(messages[:1], [], "thought-after-role", generation_prompt=False,
                                              thinking=False)  # kept from the second request
