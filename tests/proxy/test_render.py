"""Exact-id continuity in the renderer, with the model's real tokenizer and chat template."""

import random
from pathlib import Path

import pytest

from polar_lab.proxy.render import PieceEncoder, Renderer, Tip, TipCache, _longest_prefix_tip, common_prefix_len
from polar_lab.templates import with_empty_think
from tests.timing import returns

SYSTEM = {"role": "system", "content": "You are careful."}
USER = {"role": "user", "content": "What is 2+3?"}


def _tip(renderer, messages, output_text, call_id="c0"):
    """What the proxy remembers after a call: prompt + output text, and the ids behind them."""
    first = renderer.render(messages, [])
    out_ids = renderer.encode(output_text) + [renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return Tip(call_id, first.text + renderer.decode(out_ids), first.prompt_ids + out_ids)


def test_a_continued_prompt_reuses_the_sampled_ids_verbatim(tokenizer):
    r = Renderer(tokenizer)
    first = r.render([SYSTEM, USER], [])
    # "sampled" ids that are provably not the canonical tokenisation of their text: one token per character,
    # as a model may sample them; re-tokenising the text (what continuity must never do) merges them
    answer = "The answer is 5."
    sampled = [i for ch in answer for i in r.encode(ch)] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert r.encode(r.decode(sampled)) != sampled
    tip = Tip("c0", first.text + r.decode(sampled), first.prompt_ids + sampled)
    follow = [SYSTEM, USER, {"role": "assistant", "content": answer}, {"role": "user", "content": "And 2*3?"}]
    rendered = r.render(follow, [], tips=[tip])
    assert rendered.info["mode"] == "continued" and rendered.info["from_call"] == "c0"
    assert rendered.prompt_ids[:len(tip.ids)] == tip.ids  # the sampled ids, verbatim
    assert rendered.prompt_ids != r.encode(rendered.text)  # (the whole-text tokenisation differs)
    assert r.decode(rendered.prompt_ids) == rendered.text


def test_without_tips_the_prompt_is_tokenised_in_full(tokenizer):
    rendered = Renderer(tokenizer).render([SYSTEM, USER], [])
    assert rendered.info["mode"] == "full"
    assert rendered.prompt_ids == tokenizer.encode(rendered.text, add_special_tokens=False)


def test_a_divergence_is_recorded_with_call_position_and_context(tokenizer):
    r = Renderer(tokenizer)
    tip = _tip(r, [SYSTEM, USER], "The answer is 5.")
    edited = [SYSTEM, USER, {"role": "assistant", "content": "The answer is 6."}, {"role": "user", "content": "ok"}]
    rendered = r.render(edited, [], tips=[tip])
    div = rendered.info["divergence"]
    assert rendered.info["mode"] == "diverged" and div["from_call"] == "c0"
    assert rendered.text[:div["char"]] == tip.text[:div["char"]] and rendered.text[div["char"]] == "6"
    assert r.decode(tip.ids[:div["token"]]) == tip.text[:len(r.decode(tip.ids[:div["token"]]))]
    assert "5" in div["tip_context"] and "6" in div["prompt_context"]


def test_the_longest_matching_tip_is_used(tokenizer):
    r = Renderer(tokenizer)
    short = _tip(r, [SYSTEM, USER], "5", call_id="short")
    long_msgs = [SYSTEM, USER, {"role": "assistant", "content": "5"}, {"role": "user", "content": "again"}]
    long_tip = _tip(r, long_msgs, "5", call_id="long")
    rendered = r.render(long_msgs + [{"role": "assistant", "content": "5"}, {"role": "user", "content": "x"}], [],
                        tips=[short, long_tip])
    assert rendered.info["from_call"] == "long"


def test_a_session_template_overrides_the_model_template(tokenizer):
    variant = with_empty_think(tokenizer.chat_template)
    rendered = Renderer(tokenizer).render([SYSTEM, USER], [], chat_template=variant)
    assert rendered.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tip_cache_is_bounded_per_session_and_in_sessions():
    cache = TipCache(per_session=2, sessions=2)
    for i in range(3):
        cache.add("a", Tip(str(i), "", []))
    assert [t.call_id for t in cache.get("a")] == ["1", "2"]
    cache.add("b", Tip("b", "", []))
    cache.add("c", Tip("c", "", []))
    assert cache.get("a") == [] and cache.get("c")[0].call_id == "c"
    assert [t.call_id for t in cache.get("b")] == ["b"]  # the two newest sessions stay


def test_tips_stay_within_a_byte_budget_and_a_closed_sessions_are_dropped():
    cache = TipCache(max_bytes=1000)
    cache.add("a", Tip("a0", "x" * 100, [1] * 10))  # 100 + 36 * 10 bytes
    cache.add("b", Tip("b0", "y" * 100, [2] * 10))
    assert cache.nbytes == 920 and cache.get("a")
    cache.add("c", Tip("c0", "z" * 100, [3] * 10))  # over budget: the oldest session goes
    assert cache.get("a") == [] and cache.get("b") and cache.get("c") and cache.nbytes == 920
    assert cache.drop("b") == 460 and cache.drop("never-seen") == 0  # what was freed, for release_memory
    assert cache.get("b") == [] and cache.nbytes == 460


# Piece-wise tokenisation must give exactly the ids of whole-text tokenisation. The texts mix the model's
# added tokens with the characters BPE merges are most sensitive to around them (spaces, newlines, braces).
_BITS = ["hello", " world", "\n", "  ", "\t", '{"a": 1}', "é", "中文", "x", " ", "<", ">", "|", "im", "_start",
         "tool", "\n\n", "123", " 4", "</", "think", "call>"]
SMOLLM2 = Path(__file__).resolve().parents[2] / "data" / "models" / "smollm2-135m-instruct"


def _random_texts(specials: list[str], n: int = 2000) -> list[str]:
    rng = random.Random(0)
    return ["".join(rng.choice(_BITS + specials) for _ in range(rng.randint(1, 40))) for _ in range(n)]


@pytest.mark.parametrize("which", ["tiny-calc", "smollm2"])
def test_piece_encoder_equals_whole_text_tokenisation(tokenizer, which):
    if which == "smollm2":
        if not (SMOLLM2 / "config.json").exists():
            pytest.skip("run `make smollm2` to build the model folder")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    pieces = PieceEncoder(tokenizer)
    assert pieces.exact
    long_system = {"role": "system", "content": "You are careful. Check every step twice.\n" * 12}
    texts = _random_texts(list(pieces._ids)) + [Renderer(tokenizer).render([long_system, USER], []).text]
    for text in texts + texts:  # the second pass is served from the cache where pieces are long enough
        assert pieces.encode(text) == tokenizer.encode(text, add_special_tokens=False), repr(text)
    assert any(len(piece) >= pieces.min_cached_chars for piece in pieces._cache)  # the system prompt + tools


@pytest.mark.parametrize("strip", ["lstrip", "rstrip", "single_word"])
def test_piece_encoder_refuses_tokenizers_whose_added_tokens_strip_whitespace(model_path, strip):
    from tokenizers import AddedToken

    tokenizer = _with_bos(model_path)  # and a BOS the post-processor adds: never inside a prompt
    tokenizer.add_tokens([AddedToken("<mask>", **{strip: True})])
    assert not PieceEncoder(tokenizer).exact  # then every text is tokenised whole
    renderer = Renderer(tokenizer)
    assert renderer.encode("a <mask> b") == tokenizer.encode("a <mask> b", add_special_tokens=False)


def _with_bos(model_path):
    """The model's tokenizer with a post-processor that adds a BOS token, as Llama-family tokenizers do."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    bos = "<|endoftext|>"
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.convert_tokens_to_ids(bos))])
    assert tokenizer.encode("hi")[0] == tokenizer.convert_tokens_to_ids(bos)  # the BOS is really added
    return tokenizer


def test_pieces_never_carry_the_bos_a_post_processor_adds(model_path):
    tokenizer = _with_bos(model_path)
    text = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n" + "long system prompt " * 20
    assert PieceEncoder(tokenizer).encode(text) == tokenizer.encode(text, add_special_tokens=False)


def test_piece_encoder_matches_the_longest_added_token_like_the_tokenizer(model_path):
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.add_tokens([AddedToken("<x>", normalized=False), AddedToken("<x>y", normalized=False)])
    pieces = PieceEncoder(tokenizer)  # one added token is a prefix of the other: the longer one wins
    assert pieces.exact
    for text in ["<x>y", "a<x>yb<x>", "<x><x>y", "<x>"]:
        assert pieces.encode(text) == tokenizer.encode(text, add_special_tokens=False), text
    assert tokenizer.encode("<x>y", add_special_tokens=False) == [pieces._ids["<x>y"]]


def test_pieces_split_at_added_tokens_and_long_ones_come_from_a_bounded_cache(tokenizer):
    pieces = PieceEncoder(tokenizer, min_cached_chars=5, max_entries=2)
    encoded, backend = [], pieces.backend

    class Counting:  # the real backend, recording what it is asked to tokenise
        def encode(self, text, add_special_tokens):
            encoded.append(text)
            return backend.encode(text, add_special_tokens=add_special_tokens)

    pieces.backend = Counting()
    text = "<|im_start|>abcd<|im_end|>abcde<|im_end|>"
    assert pieces.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert encoded == ["abcd", "abcde"]  # split at the added tokens, never across them
    assert list(pieces._cache) == ["abcde"]  # 5 characters and more are cached, 4 are not
    encoded.clear()
    assert pieces.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert encoded == ["abcd"]  # the long piece came from the cache
    pieces.encode("fghij")
    pieces.encode("klmno")
    assert list(pieces._cache) == ["fghij", "klmno"]  # at most 2 entries; the least recently used goes


def test_a_tokenizer_without_a_fast_backend_is_tokenised_whole():
    class Plain:  # a slow (pure-Python) tokenizer has no backend_tokenizer
        def encode(self, text, add_special_tokens):
            return [ord(c) for c in text] if not add_special_tokens else [0] + [ord(c) for c in text]

    pieces = PieceEncoder(Plain())
    assert not pieces.exact and pieces.encode("ab") == [97, 98]


def test_a_continued_render_says_what_it_reused_and_what_it_appended(tokenizer):
    r = Renderer(tokenizer)
    tip = _tip(r, [SYSTEM, USER], "The answer is 5.")
    follow = [SYSTEM, USER, {"role": "assistant", "content": "The answer is 5."}, {"role": "user", "content": "x"}]
    rendered = r.render(follow, [], prefill="<tool_call>\n", tips=[tip])
    info = rendered.info
    assert info["mode"] == "continued" and info["reused_tokens"] == len(tip.ids)
    assert rendered.text.endswith("<|im_start|>assistant\n<tool_call>\n")
    assert info["prompt_chars"] == len(rendered.text) and info["prefill"] == "<tool_call>\n"
    assert 0 <= info["render_s"] < 5


def test_tools_reach_the_template_and_a_template_error_is_the_callers(tokenizer):
    from polar_lab.errors import RequestError
    from polar_lab.harness import CALC_TOOL

    r = Renderer(tokenizer)
    assert '"calculator"' in r.render([SYSTEM, USER], [CALC_TOOL]).text
    assert '"calculator"' not in r.render([SYSTEM, USER], []).text
    with pytest.raises(RequestError, match="chat template cannot render these messages: no") as caught:
        r.render([USER], [], chat_template="{{ raise_exception('no') }}")
    assert caught.value.param == "messages"


def test_forced_prefill_opens_a_tool_call_in_the_templates_shape(tokenizer):
    import copy

    r = Renderer(tokenizer)
    assert r.supports_tool_calls
    assert r.forced_prefill({"name": "calculator"}) == '<tool_call>\n{"name": "calculator", "arguments":'
    assert r.forced_prefill("required") == '<tool_call>\n{"name": "'
    assert r.forced_prefill("auto") == "" and r.forced_prefill("none") == ""
    plain = copy.copy(tokenizer)
    plain.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert not Renderer(plain).supports_tool_calls and Renderer(plain).forced_prefill("required") == ""


def test_the_divergence_is_measured_from_the_closest_tip(tokenizer):
    r = Renderer(tokenizer)
    far = _tip(r, [SYSTEM, USER], "Nothing alike.", call_id="far")
    near = _tip(r, [SYSTEM, USER], "The answer is 5.", call_id="near")
    edited = [SYSTEM, USER, {"role": "assistant", "content": "The answer is 6."}, {"role": "user", "content": "ok"}]
    for tips in ([far, near], [near, far]):
        div = r.render(edited, [], tips=tips).info["divergence"]
        assert div["from_call"] == "near" and div["tip_chars"] == len(near.text)


def test_a_divergence_near_the_start_keeps_the_context_there_is(tokenizer):
    r = Renderer(tokenizer)
    tip = _tip(r, [SYSTEM, USER], "5")
    other = r.render([{"role": "system", "content": "Zzz."}, USER], [], tips=[tip])
    div = other.info["divergence"]
    at = div["char"]
    assert 0 < at < 40 and other.text[:at] == tip.text[:at] != other.text[:at + 1]
    assert div["prompt_context"] == other.text[:at + 40] and div["tip_context"] == tip.text[:at + 40]


def test_token_at_finds_the_token_that_holds_each_character(tokenizer):
    r = Renderer(tokenizer)
    ids = r.encode("<|im_start|>user\nWhat is 12*7+5?")
    ends = [len(r.decode(ids[:i + 1])) for i in range(len(ids))]  # where each token's text ends
    for char in range(ends[-1]):
        assert returns(r._token_at, ids, char) == next(i for i, end in enumerate(ends) if end > char), char


@pytest.mark.parametrize("a, b, n", [("", "", 0), ("abc", "xyz", 0), ("abc", "abd", 2), ("abc", "abc", 3),
                                     ("ab", "abc", 2), ("abc", "ab", 2), ("a" * 999 + "x", "a" * 999 + "y", 999)])
def test_common_prefix_len(a, b, n):
    assert returns(common_prefix_len, a, b) == n


def test_the_tip_reused_is_the_longest_that_does_not_end_inside_a_spliced_turn():
    """A spliced turn's ids are whole: a tip may end before it or after it, never inside it (at its edges is fine)."""
    from polar_lab.proxy.splice import Turn

    def turn(text):
        return Turn(call_id="c", opening="", ids=(1,) * len(text), text=text, stop="", content=text, reasoning=None,
                    tool_calls=())

    segments = ["ab", turn("cd"), "ef", turn("gh"), "ij"]  # turns at [2, 4) and [6, 8)
    text = "abcdefghij"
    tips = {n: Tip(f"c{n}", text[:n], list(range(n))) for n in range(1, 11)}
    allowed = [n for n in tips if n not in (3, 7)]
    assert _longest_prefix_tip(text, list(tips.values()), segments) is tips[10]
    for n in (3, 7):  # inside a turn: passed over for the longest before it
        assert _longest_prefix_tip(text, [tips[k] for k in range(1, n + 1)], segments) is tips[n - 1]
    assert [k for k in tips if _longest_prefix_tip(text, [tips[k]], segments) is not None] == allowed


def test_decode_is_exact_whatever_the_tokenizers_cleanup_default(model_path):
    from transformers import AutoTokenizer

    text = "a , b . c 's d ! <|im_end|>"
    for cleanup in (False, True):
        tokenizer = AutoTokenizer.from_pretrained(model_path, clean_up_tokenization_spaces=cleanup)
        r = Renderer(tokenizer)
        assert r.decode(r.encode(text)) == text


def test_xml_templates_get_each_calls_json_arguments_as_an_object_and_anything_else_as_sent():
    """XML-format templates iterate over a call's arguments: a JSON object string becomes the object, in the
    OpenAI shape ({"function": {...}}) and the flat one ({"name", "arguments"}) alike; arguments that are not a JSON
    object (not JSON, a list) stay the string the harness sent. The harness's message is not changed."""
    from polar_lab.proxy.render import _arguments_as_objects

    nested = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    flat = {"name": "g", "arguments": '{"b": [2]}'}
    odd = [{"function": {"name": "h", "arguments": "not json"}}, {"name": "k", "arguments": "[1, 2]"}]
    message = {"role": "assistant", "content": "", "tool_calls": [nested, flat, *odd]}
    out = _arguments_as_objects(message)
    assert out["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
        {"name": "g", "arguments": {"b": [2]}},  # flat stays flat: no "function" key added
        {"function": {"name": "h", "arguments": "not json"}},
        {"name": "k", "arguments": "[1, 2]"}]
    assert nested["function"]["arguments"] == '{"a": 1}' and flat["arguments"] == '{"b": [2]}'  # not mutated
    assert out["role"] == "assistant" and out["content"] == ""


def test_template_text_renders_the_whole_template_with_each_switch_the_request_gave():
    """What `/tokenize` shows: tools, the generation prompt, the thinking switch and a session's own template each
    reach the template."""
    from transformers import AutoTokenizer

    from polar_lab.proxy.formats import FORMATS

    qwen35 = Path("data/models/tiny-calc-qwen35")
    if not (qwen35 / "tokenizer.json").exists():
        pytest.skip("run `python scripts/build_tiny_model.py --family qwen35`")
    r = Renderer(AutoTokenizer.from_pretrained(qwen35), FORMATS["qwen3_coder"])
    tools = [{"type": "function", "function": {"name": "calculator", "description": "Evaluates arithmetic.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    bare = r.template_text([SYSTEM, USER], [], generation_prompt=False)
    prompt = r.template_text([SYSTEM, USER], [])
    assert prompt.startswith(bare) and prompt != bare and prompt.endswith("<think>\n")
    assert r.template_text([SYSTEM, USER], [], thinking=False).endswith("</think>\n\n")
    assert "calculator" in r.template_text([SYSTEM, USER], tools) and "calculator" not in prompt
    assert r.template_text([SYSTEM, USER], [], "{{ messages[-1].content }}!") == "What is 2+3?!"


def test_the_tip_cache_keeps_the_newest_tips_and_sessions_within_its_bounds():
    def tip(n, k):  # 37·k bytes as the cache counts them: 36 an id, 1 a character
        return Tip(f"c{n}", "x" * k, [0] * k)

    cache = TipCache(per_session=2, sessions=2, max_bytes=37 * 6)
    for n in range(3):  # room for two tips a session: the oldest goes
        cache.add("s", tip(n, 1))
    assert [t.call_id for t in cache.get("s")] == ["c1", "c2"] and cache.nbytes == 37 * 2
    cache.add("t", tip(3, 4))  # exactly at max_bytes: kept
    assert len(cache.get("s")) == 2 and cache.nbytes == 37 * 6
    cache.add("t", tip(4, 1))  # over it: the oldest session goes
    assert cache.get("s") == [] and cache.nbytes == 37 * 5
    assert cache.drop("t") == 37 * 5 and cache.nbytes == 0


def test_the_thinking_switch_reaches_a_render_whole_and_by_the_sessions_history():
    from transformers import AutoTokenizer

    from polar_lab.proxy.formats import FORMATS

    qwen35 = Path("data/models/tiny-calc-qwen35")
    if not (qwen35 / "tokenizer.json").exists():
        pytest.skip("run `python scripts/build_tiny_model.py --family qwen35`")
    r = Renderer(AutoTokenizer.from_pretrained(qwen35), FORMATS["qwen3_coder"])
    for session in (None, "s"):
        assert r.render([SYSTEM, USER], [], thinking=False, session=session).text.endswith("</think>\n\n")
        assert r.render([SYSTEM, USER], [], session=session).text.endswith("<think>\n")  # the template's default
