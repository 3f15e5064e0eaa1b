"""Synthetic calculator data for the tiny-calc model (used by build_tiny_model.py).

Everything here is pure Python and seeded through an explicit ``random.Random``:

- ``random_expression``: 2-3 integer operands of 1-3 digits joined by + - * (optional parentheses);
- ``safe_eval``: evaluates such expressions through ``ast`` (no ``eval``);
- ``make_task_splits``: disjoint test / train task lists (the JSONL files under data/tasks);
- ``sft_conversation``: one OpenAI-format chat transcript, with a deliberate mixture of
  "direct" answers and "near-miss" final answers (fractions passed in by the caller);
- ``parse_tool_call`` / ``last_integer``: what the evaluation uses to read model output.
"""

from __future__ import annotations

import json
import random
import re

# The prompt, tool and evaluator are the harness's own: the model is trained on exactly what it will see.
from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT, safe_eval  # noqa: E402,F401
from polar_lab.harness.demonstrator import near_miss  # noqa: E402 - the same mistakes the CLI demonstrator makes
from polar_lab.rewards import last_integer  # noqa: E402,F401 - the evaluator the RL reward uses

QUESTION_TEMPLATES = (
    "What is {e}?",
    "Compute {e}.",
    "Calculate: {e}",
    "What's {e}?",
    "Please evaluate {e}.",
    "Work out {e} for me.",
    "{e} = ?",
    "How much is {e}?",
)

ANSWER_TEMPLATES = (
    "The answer is {a}.",
    "The answer is {a}.",
    "The result is {a}.",
    "{e} = {a}",
    "It equals {a}.",
)

def _operand(rng: random.Random) -> int:
    digits = rng.choice((1, 2, 3))
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def random_expression(rng: random.Random) -> str:
    """2-3 operands of 1-3 digits with + - *; three-operand forms sometimes get parentheses."""
    ops = "+-*"
    a, b = _operand(rng), _operand(rng)
    if rng.random() < 0.4:
        return f"{a}{rng.choice(ops)}{b}"
    c = _operand(rng)
    op1, op2 = rng.choice(ops), rng.choice(ops)
    form = rng.random()
    if form < 0.6:
        return f"{a}{op1}{b}{op2}{c}"
    if form < 0.8:
        return f"({a}{op1}{b}){op2}{c}"
    return f"{a}{op1}({b}{op2}{c})"


def unique_expressions(rng: random.Random, n: int, exclude: set[str]) -> list[str]:
    """``n`` distinct expressions not in ``exclude`` (``exclude`` is updated in place)."""
    out: list[str] = []
    while len(out) < n:
        expr = random_expression(rng)
        if expr not in exclude:
            exclude.add(expr)
            out.append(expr)
    return out


def make_task(rng: random.Random, task_id: str, expression: str) -> dict:
    question = rng.choice(QUESTION_TEMPLATES).format(e=expression)
    return {"id": task_id, "question": question, "expression": expression,
            "answer": safe_eval(expression)}


def make_task_splits(rng: random.Random, n_train: int, n_test: int) -> tuple[list, list, set]:
    """Disjoint test and train tasks; returns them plus the set of used expressions."""
    used: set[str] = set()
    test = [make_task(rng, f"calc-test-{i:04d}", e)
            for i, e in enumerate(unique_expressions(rng, n_test, used))]
    train = [make_task(rng, f"calc-train-{i:04d}", e)
             for i, e in enumerate(unique_expressions(rng, n_train, used))]
    return train, test, used


def sft_conversation(rng: random.Random, expression: str, p_direct: float,
                     p_wrong_final: float) -> tuple[list[dict], str]:
    """One chat transcript for supervised training and its kind ("copy", "direct" or a near-miss kind).

    ``p_direct``: fraction answering without the tool; ``p_wrong_final``: fraction of tool-using
    transcripts whose final answer is a near miss instead of the tool's result.
    """
    answer = safe_eval(expression)
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": rng.choice(QUESTION_TEMPLATES).format(e=expression)}]
    final_template = rng.choice(ANSWER_TEMPLATES)
    if rng.random() < p_direct:
        messages.append({"role": "assistant", "content": final_template.format(e=expression, a=answer)})
        return messages, "direct"
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    messages.append({"role": "assistant", "content": rng.choice(("", None)), "tool_calls": [call]})
    messages.append({"role": "tool", "content": str(answer)})
    kind, final = "copy", answer
    if rng.random() < p_wrong_final:
        final, kind = near_miss(rng, expression, answer)
    messages.append({"role": "assistant", "content": final_template.format(e=expression, a=final)})
    return messages, kind


TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_call(text: str) -> dict | None:
    """The first Hermes-style calculator call in ``text`` as {"name", "arguments"}, else None."""
    match = TOOL_CALL_RE.search(text)
    if not match:
        return None
    try:
        call = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") != "calculator":
        return None
    args = call.get("arguments")
    if not isinstance(args, dict) or not isinstance(args.get("expression"), str):
        return None
    return call


XML_CALL_RE = re.compile(r"<tool_call>\s*<function=(?P<name>[^>\n]+)>\s*<parameter=expression>\n(?P<expr>.*?)\n"
                         r"</parameter>\s*</function>\s*</tool_call>", re.DOTALL)


def parse_tool_call_xml(text: str) -> dict | None:
    """The first Qwen3.5-format (XML) calculator call in ``text`` as {"name", "arguments"}, else None."""
    match = XML_CALL_RE.search(text)
    if not match or match["name"] != "calculator":
        return None
    return {"name": "calculator", "arguments": {"expression": match["expr"]}}


def _calculator_call(obj, key: str) -> dict | None:
    """{"name", "arguments"} when obj is a calculator call whose `key` holds {"expression": str}, else None."""
    if not isinstance(obj, dict) or obj.get("name") != "calculator":
        return None
    args = obj.get(key)
    if not isinstance(args, dict) or not isinstance(args.get("expression"), str):
        return None
    return {"name": "calculator", "arguments": args}


def parse_tool_call_llama3(text: str) -> dict | None:
    """The first Llama-3-format calculator call (`<|python_tag|>{"name": ..., "parameters": {...}}`), else None."""
    _, tag, body = text.partition("<|python_tag|>")
    try:
        obj, _ = json.JSONDecoder().raw_decode(body.lstrip()) if tag else (None, 0)
    except json.JSONDecodeError:
        return None
    return _calculator_call(obj, "parameters")


def parse_tool_call_mistral(text: str) -> dict | None:
    """The first Mistral-v11-format calculator call (`[TOOL_CALLS]calculator[ARGS]{...}`), else None."""
    _, tag, body = text.partition("[TOOL_CALLS]")
    name, args_tag, args = body.partition("[ARGS]")
    if not tag or not args_tag:
        return None
    try:
        obj, _ = json.JSONDecoder().raw_decode(args.lstrip())
    except json.JSONDecodeError:
        return None
    return _calculator_call({"name": name.strip(), "arguments": obj}, "arguments")


# Short thoughts for the thinking (Qwen3.5-format) fixture: before the call, and before the final answer.
THOUGHTS_CALL = ("I should use the calculator for {e}.", "Let me compute {e} with the tool.", "Use the tool on {e}.")
THOUGHTS_FINAL = ("The tool returned {r}.", "The result is {r}.", "The calculator says {r}.")
THOUGHTS_DIRECT = ("I can answer this directly.", "No tool needed.")


def add_thoughts(rng: random.Random, messages: list[dict], expression: str) -> list[dict]:
    """The transcript with a short `reasoning_content` on each assistant turn (the tool's result in the last)."""
    result = next((m["content"] for m in messages if m["role"] == "tool"), None)
    out = []
    for m in messages:
        if m["role"] == "assistant":
            pool = THOUGHTS_CALL if m.get("tool_calls") else THOUGHTS_FINAL if result is not None else THOUGHTS_DIRECT
            m = {**m, "reasoning_content": rng.choice(pool).format(e=expression, r=result)}
        out.append(m)
    return out


def run_tool(call: dict) -> str:
    """The tool message content for a parsed call: the integer result, or an error string."""
    try:
        return str(safe_eval(call["arguments"]["expression"]))
    except (ValueError, RecursionError, OverflowError) as exc:
        return f"Error: {exc}"


def _first_turn_messages(task: dict) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]


def evaluate_episodes(tasks: list[dict], render, generate, parse=parse_tool_call,
                      call_open: str = "<tool_call>") -> tuple[dict, list[dict]]:
    """Two-turn calculator episodes, batched: returns (summary rates, per-task records).

    ``render(messages) -> str`` renders a prompt ending in the assistant header;
    ``generate(prompts) -> list[str]`` samples one completion per prompt (text up to ``<|im_end|>``);
    ``parse(text)`` reads the call (Hermes by default), which starts with ``call_open``. A completion that starts inside a thought the prompt
    opened (`...</think>`) has it split off as the turn's reasoning.
    A run is correct when the last integer of the final assistant text equals the task's answer.
    """
    convs = [_first_turn_messages(t) for t in tasks]
    first = generate([render(c) for c in convs])
    records, second_prompts, second_idx = [], [], []
    for i, (task, text) in enumerate(zip(tasks, first)):
        call = parse(text)
        rec = {"id": task["id"], "first": text, "tool_call": call is not None, "final": text}
        if call is not None:
            result = run_tool(call)
            rec["expression_ok"] = result == str(task["answer"])
            thought, _, answer = text.rpartition("</think>")
            head = answer[: answer.find(call_open)].strip()
            tool_call = {"type": "function", "function": {"name": "calculator", "arguments": call["arguments"]}}
            turn = {"role": "assistant", "content": head, "tool_calls": [tool_call]}
            if thought:
                turn["reasoning_content"] = thought.strip("\n")
            conv = convs[i] + [turn, {"role": "tool", "content": result}]
            second_prompts.append(render(conv))
            second_idx.append(i)
        records.append(rec)
    for i, text in zip(second_idx, generate(second_prompts) if second_prompts else []):
        records[i]["final"] = text
    for task, rec in zip(tasks, records):
        rec["correct"] = last_integer(rec["final"]) == task["answer"]
    n = max(len(records), 1)
    n_calls = sum(r["tool_call"] for r in records)
    summary = {
        "n_tasks": len(records),
        "tool_call_parse_rate": n_calls / n,
        "tool_expression_correct_rate": sum(r.get("expression_ok", False) for r in records) / n,
        "final_answer_accuracy": sum(r["correct"] for r in records) / n,
        "accuracy_given_tool_call": sum(r["correct"] for r in records if r["tool_call"]) / max(n_calls, 1),
    }
    return summary, records
