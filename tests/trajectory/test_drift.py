"""Chain-break classification on text pairs (chain text as it stood, then the prompt that broke it)."""

import pytest

from polar_lab.trajectory.drift import classify

SYS = "<|im_start|>system\nYou are careful.<|im_end|>\n"
USER = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
CHAIN = SYS + USER + "<|im_start|>assistant\n" + CALL + "<|im_end|>"
NEXT = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("chain, prompt, kind", [
    # same text, different ids: a tokenisation re-merge at the boundary
    (CHAIN, CHAIN + NEXT, "token_remerge"),
    # a sub-agent: another system prompt
    (CHAIN, "<|im_start|>system\nYou check arithmetic.<|im_end|>\n" + USER, "new_context"),
    # the template dropped the (empty) think block the generation prompt had
    (SYS + USER + "<|im_start|>assistant\n<think>\n\n</think>\n\n" + CALL + "<|im_end|>",
     CHAIN + NEXT, "thinking_stripped"),
    # the harness re-serialised the tool-call JSON without spaces
    (CHAIN, CHAIN.replace('{"expression": "2+3"}', '{"expression":"2+3"}') + NEXT, "tool_call_rerendered"),
    # the harness added a newline after the assistant's content
    (CHAIN.replace(CALL, "The answer is 5."), (CHAIN.replace(CALL, "The answer is 5.\n")) + NEXT, "whitespace"),
    # history replaced by a summary
    (CHAIN + NEXT + "The answer is 5.<|im_end|>", SYS + "<|im_start|>user\nSummary: 5. Next?<|im_end|>\n",
     "truncation_compaction"),
    # the harness edited a turn in place (every turn still there, same roles): rewritten, not compacted
    (CHAIN.replace(CALL, "The answer is 5."), CHAIN.replace(CALL, "The answer is 6.") + NEXT, "history_rewritten"),
    (CHAIN + NEXT + "5<|im_end|>", CHAIN.replace("What is 2+3?", "What is 2+3? Be brief.") + NEXT + "5<|im_end|>\n"
     + "<|im_start|>user\nNext?<|im_end|>\n", "history_rewritten"),
    # the harness re-ordered its history (the same turns, another order)
    (SYS + USER + "<|im_start|>user\nAnd 4+4?<|im_end|>\n<|im_start|>assistant\n" + CALL + "<|im_end|>",
     SYS + "<|im_start|>user\nAnd 4+4?<|im_end|>\n" + USER + "<|im_start|>assistant\n" + CALL + "<|im_end|>" + NEXT,
     "history_rewritten"),
    # a turn dropped from the middle (the rest kept in order): truncation, not a rewrite
    (CHAIN + NEXT + "5<|im_end|>", SYS + USER + "<|im_start|>assistant\n5<|im_end|>\n<|im_start|>user\nNext?<|im_end|>\n",
     "truncation_compaction"),
    # the template's own scaffolding changed (the assistant header): none of the classes above
    (CHAIN, CHAIN.replace("<|im_start|>assistant", "<|im_start|>model") + NEXT, "other"),
])
def test_classes(chain, prompt, kind):
    got, detail = classify(chain, prompt)
    assert got == kind
    assert detail["chain_context"] and detail["prompt_context"]


def test_divergence_position_and_context_point_at_the_change():
    chain = CHAIN
    prompt = CHAIN.replace("2+3", "2 + 3") + NEXT
    _, detail = classify(chain, prompt)
    assert chain[:detail["char"]] == prompt[:detail["char"]]
    assert chain[detail["char"]] != prompt[detail["char"]]


TEMPLATED = ["tiny-calc", "tiny-calc-llama3", "tiny-calc-mistral", "tiny-calc-qwen35"]


def _render(tokenizer, turns, generation=False):
    roles = ["system", "user", "assistant", "user", "assistant"]
    return tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in zip(roles, turns)], tokenize=False,
                                         add_generation_prompt=generation)


@pytest.mark.parametrize("model", TEMPLATED)
def test_the_classes_read_turns_as_each_models_own_template_writes_them(model):
    """ChatML, Llama 3's headers and Mistral's [INST] blocks: a turn edited in place or two turns swapped is
    `history_rewritten`, a dropped turn `truncation_compaction`, another system prompt `new_context` — with the turn
    format learned from the model's template. ChatML's turns alone cannot see the first two in Llama 3 or Mistral."""
    from transformers import AutoTokenizer

    from polar_lab.trajectory.drift import CHATML, TurnFormat

    tokenizer = AutoTokenizer.from_pretrained(f"data/models/{model}")
    turns = TurnFormat.of(tokenizer)
    system, ask, answer, again = "You are careful.", "What is 2+3?", "The answer is 5.", "And 4+4?"
    chain = _render(tokenizer, [system, ask, answer, again, "It is 8."])
    cases = {
        "history_rewritten": [_render(tokenizer, [system, ask, "The answer is 6.", again, "It is 8.", "Next?"], True),
                              _render(tokenizer, [system, again, answer, ask, "It is 8.", "Next?"], True)],
        "truncation_compaction": [_render(tokenizer, [system, ask + " " + again, "It is 8."], True)],
        "new_context": [_render(tokenizer, ["You check arithmetic.", ask], True)],
    }
    for kind, prompts in cases.items():
        for prompt in prompts:
            assert classify(chain, prompt, turns)[0] == kind, (kind, prompt)
    if model in ("tiny-calc-llama3", "tiny-calc-mistral"):
        assert classify(chain, cases["history_rewritten"][0], CHATML)[0] != "history_rewritten"
    if model == "tiny-calc":
        assert turns == CHATML
