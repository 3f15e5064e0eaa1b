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
