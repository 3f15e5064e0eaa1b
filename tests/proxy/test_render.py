"""Exact-id continuity in the renderer, with the model's real tokenizer and chat template."""

import random
from pathlib import Path

import pytest

from polar_lab.proxy.render import PieceEncoder, Renderer, Tip, TipCache
from polar_lab.templates import with_empty_think

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


def test_piece_encoder_refuses_tokenizers_whose_added_tokens_strip_whitespace(model_path):
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.add_tokens([AddedToken("<mask>", lstrip=True)])
    assert not PieceEncoder(tokenizer).exact  # then every text is tokenised whole
    renderer = Renderer(tokenizer)
    assert renderer.encode("a <mask> b") == tokenizer.encode("a <mask> b", add_special_tokens=False)
