"""A scripted policy that acts inside the paper's CLIs: it reads a prompt in Qwen3.5's format and writes the next turn.

The demonstrator of DESIGN.md's fourth wave. It is the reply function of a ScriptedEngine (engine/fake.py), so the
unmodified CLIs run against it through the proxy and every call is recorded token-exact, as any run is;
`scripts/build_tiny_agent.py` trains the tiny-agent fixture on those records (`sft_dataset`).

What it reads (`read_prompt`): the tools the CLI offers (the template's `<tools>` block), the user messages, and the
tool results since the last of them. It finds its task by the task's prompt text inside the last user message (a
CLI wraps it in reminders and context). What it writes: a short thought, then one call of that CLI's own tool
(`Toolset`: Codex `exec_command`; Claude Code `Bash`, `Read`, `Edit`; Qwen Code `run_shell_command`, `read_file`,
`edit`; Pi `bash`, `edit`), or the final answer. The step is the number of tool results since the task's message:

    arithmetic   0 run `python3 -c 'print(EXPR)'`   1 answer with the number the command printed
    swe          0 list the Python files   1 read the module   2 edit it   3 run the tests   4 say what was fixed

`Mistakes` makes it err on purpose at seeded rates (an answer without the tool, a near-miss final answer, a wrong
edit), so that a model trained on its sessions leaves reinforcement learning room. Each call draws from its own
sampling seed (a rollout's `seed` gives every call one), so a recorded set is the same run after run.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from dataclasses import dataclass, field
from typing import Any

from polar_lab.types import SamplingSpec

_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?=<\|im_end\|>|\Z)", re.S)
_TOOLS = re.compile(r"<tools>\n(.*?)\n</tools>", re.S)
_RESULT = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)
# how each CLI states its working directory: Codex `<cwd>`, Claude Code "CWD:", Qwen Code "working in the directory:",
# Pi "Current working directory:"
_CWD = re.compile(r"(?:<cwd>|CWD:\s*|working in the directory:\s*|working directory:\s*)(/[^\s<]+)", re.I)
_PRINTED = re.compile(r"Output:\s*(-?\d+)")  # Codex ("Output:\n23") and Qwen Code ("Output: 23") label the output
_INT = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Prompt:
    """What a rendered prompt says: tools offered (name → parameter names), user messages (tool results left
    out), the tool results since the last user message, the working directory if it is stated."""

    tools: dict[str, list[str]]
    users: list[str]
    results: list[str]
    cwd: str | None

    @property
    def task_text(self) -> str:
        """The last user message without the reminders a CLI puts before the task (`<system-reminder>`...)."""
        last = self.users[-1] if self.users else ""
        return last.rsplit("</system-reminder>", 1)[-1].strip()


def read_prompt(text: str) -> Prompt:
    """Read a prompt rendered by a Qwen3.5-format chat template (ChatML turns, tools as JSON lines in `<tools>`,
    tool results as `<tool_response>` blocks in user turns).

    >>> p = read_prompt('<|im_start|>system\\n<tools>\\n{"type": "function", "function": {"name": "bash", '
    ...     '"parameters": {"properties": {"command": {}}}}}\\n</tools><|im_end|>\\n<|im_start|>user\\nCompute 2+3.'
    ...     '<|im_end|>\\n<|im_start|>assistant\\n<think>\\n')
    >>> p.tools, p.task_text, p.results
    ({'bash': ['command']}, 'Compute 2+3.', [])
    """
    tools: dict[str, list[str]] = {}
    users: list[str] = []
    results: list[str] = []
    for role, body in _TURN.findall(text):
        if role == "system":
            tools.update(_tool_params(body))
        elif role == "user" and body.startswith("<tool_response>"):
            results += _RESULT.findall(body)
        elif role == "user":
            users.append(body)
            results = []
    found = _CWD.search(text)
    return Prompt(tools, users, results, found[1] if found else None)


def _tool_params(system: str) -> dict[str, list[str]]:
    block = _TOOLS.search(system)
    out = {}
    for line in block[1].splitlines() if block else []:
        try:
            tool = json.loads(line)
        except ValueError:
            continue
        spec = tool.get("function", tool)
        schema = spec.get("parameters") or spec.get("input_schema") or {}
        if "name" in spec:
            out[spec["name"]] = list(schema.get("properties", {}))
    return out


@dataclass(frozen=True)
class Toolset:
    """One CLI's tools as the demonstrator uses them: the shell tool and its command argument; the reader and the
    editor where the CLI has its own (None: through the shell)."""

    shell: str
    command: str = "command"
    read: tuple[str, str] | None = None  # (tool, path argument)
    edit: str | None = None  # "claude" | "qwen" | "pi": the editor's argument shape


TOOLSETS = {  # keyed by the shell tool's name, which tells the CLIs apart
    "exec_command": Toolset("exec_command", "cmd"),  # Codex: everything through its shell
    "Bash": Toolset("Bash", read=("Read", "file_path"), edit="claude"),  # its Edit refuses a file it has not Read
    "run_shell_command": Toolset("run_shell_command", read=("read_file", "file_path"), edit="qwen"),  # same rule
    "bash": Toolset("bash", edit="pi"),
}


def toolset(prompt: Prompt) -> Toolset | None:
    return next((TOOLSETS[name] for name in prompt.tools if name in TOOLSETS), None)


def near_miss(rng: random.Random, expression: str, answer: int) -> tuple[int, str]:
    """A plausible wrong final answer: off by a little, one digit changed, or an operand copied.

    >>> near_miss(random.Random(0), "12+30", 42)[0] != 42
    True
    """
    kind = rng.choice(("offset", "digit", "operand"))
    if kind == "operand":
        operands = [int(x) for x in re.findall(r"\d+", expression) if int(x) != answer]
        if operands:
            return rng.choice(operands), kind
        kind = "offset"
    if kind == "digit":
        text = str(abs(answer))
        pos = rng.randrange(len(text))
        choices = [d for d in "0123456789" if d != text[pos] and not (pos == 0 and d == "0" and len(text) > 1)]
        wrong = int(text[:pos] + rng.choice(choices) + text[pos + 1:])
        return (-wrong if answer < 0 else wrong), kind
    return answer + rng.choice((-1, 1)) * rng.randint(1, 10), "offset"


@dataclass(frozen=True)
class Mistakes:
    """Rates of deliberate errors (each drawn from the call's own seed).

    direct      arithmetic: answer at once, without the tool (a guess: the task's operand)
    wrong_final arithmetic: of the runs that used the tool, a near miss of what it printed (`near_miss`)
    wrong_edit  swe: an edit that does not fix the bug (an operator or constant of the fix changed)
    """

    direct: float = 0.0
    wrong_final: float = 0.0
    wrong_edit: float = 0.0


def turn(thought: str, call: tuple[str, dict[str, Any]] | None = None, text: str = "") -> str:
    """A completion after the generation prompt's `<think>\\n`: the thought, then a Qwen3.5 XML call or the text.

    >>> print(turn("Run it.", ("bash", {"command": "ls"})))
    Run it.
    </think>
    <BLANKLINE>
    <tool_call>
    <function=bash>
    <parameter=command>
    ls
    </parameter>
    </function>
    </tool_call>
    """
    head = f"{thought}\n</think>\n\n"
    if call is None:
        return head + text
    name, args = call
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                      for k, v in args.items())
    return f"{head}<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def printed_number(result: str) -> int | None:
    """The number a command printed, as a CLI reports it (after "Output:" where it labels the output, else the last
    integer of the result).

    >>> printed_number("Command: python3 -c 'print(2+3)'\\nOutput: 5\\nExit Code: 0"), printed_number("5\\n")
    (5, 5)
    """
    found = _PRINTED.search(result)
    if found:
        return int(found[1])
    numbers = _INT.findall(result)
    return int(numbers[-1]) if numbers else None


def shell_call(tools: Toolset, command: str) -> tuple[str, dict[str, Any]]:
    return tools.shell, {tools.command: command}


def arithmetic(prompt: Prompt, tools: Toolset, task: dict[str, Any], rng: random.Random,
               mistakes: Mistakes) -> str:
    expression = task["expression"]
    if not prompt.results:
        if rng.random() < mistakes.direct:
            return turn("I can answer this directly.", text=f"The answer is {_operand(expression)}.")
        return turn("I will run it in Python.", shell_call(tools, f"python3 -c 'print({expression})'"))
    value = printed_number(prompt.results[-1])
    if value is None:
        return turn("The command printed no number.", text="I could not compute it.")
    if rng.random() < mistakes.wrong_final:
        value, _ = near_miss(rng, expression, value)
    return turn("The command printed the result.", text=f"The answer is {value}.")


def _operand(expression: str) -> int:
    return int(_INT.findall(expression)[0])


@dataclass(frozen=True)
class Fix:
    """A SWE task's fix as the demonstrator applies it: the module's path in the repository, and the text that
    replaces another in it (read from the task's reference patch)."""

    path: str
    old: str
    new: str

    @classmethod
    def of(cls, task: dict[str, Any]) -> Fix:
        """From a unified diff of one file (the rows' `reference_patch`): its `-` lines → its `+` lines."""
        lines = task["reference_patch"].splitlines()
        path = next(line[len("+++ b/"):] for line in lines if line.startswith("+++ b/"))
        body = [line for line in lines if line[:1] in "-+" and not line.startswith(("---", "+++"))]
        old = "".join(line[1:] + "\n" for line in body if line.startswith("-"))
        new = "".join(line[1:] + "\n" for line in body if line.startswith("+"))
        return cls(path, old, new)


def wrong(fix: Fix, rng: random.Random) -> Fix:
    """The fix with one operator or digit of its new text changed: an edit that does not fix the bug."""
    spots = [i for i, ch in enumerate(fix.new) if ch in "+-*/<>0123456789"]
    if not spots:
        return Fix(fix.path, fix.old, fix.old)
    i = rng.choice(spots)
    swap = {"+": "-", "-": "+", "*": "+", "/": "*", "<": ">", ">": "<"}.get(fix.new[i], str((int(fix.new[i]) + 1) % 10)
                                                                          if fix.new[i].isdigit() else fix.new[i])
    return Fix(fix.path, fix.old, fix.new[:i] + swap + fix.new[i + 1:])


def edit_call(tools: Toolset, fix: Fix, cwd: str) -> tuple[str, dict[str, Any]]:
    """The edit in the CLI's own editor, or as a Python replacement through its shell (Codex has no editor)."""
    path = f"{cwd.rstrip('/')}/{fix.path}"
    if tools.edit in ("claude", "qwen"):
        return ("Edit" if tools.edit == "claude" else "edit"), {"file_path": path, "old_string": fix.old,
                                                                 "new_string": fix.new}
    if tools.edit == "pi":
        return "edit", {"path": fix.path, "edits": [{"oldText": fix.old, "newText": fix.new}]}
    script = (f"from pathlib import Path\np = Path({fix.path!r})\n"
              f"p.write_text(p.read_text().replace({fix.old!r}, {fix.new!r}))")
    return shell_call(tools, f"python3 - <<'EOF'\n{script}\nEOF")


def swe(prompt: Prompt, tools: Toolset, task: dict[str, Any], rng: random.Random, mistakes: Mistakes) -> str:
    fix, step, cwd = Fix.of(task), len(prompt.results), prompt.cwd or "."
    if step == 0:
        return turn("Find the module.", shell_call(tools, "find . -name '*.py' | sort"))
    if step == 1:
        if tools.read is not None:
            name, arg = tools.read
            return turn("Read the module.", (name, {arg: f"{cwd.rstrip('/')}/{fix.path}"}))
        return turn("Read the module.", shell_call(tools, f"cat {fix.path}"))
    if step == 2:
        if rng.random() < mistakes.wrong_edit:
            fix = wrong(fix, rng)
        return turn("Fix the bug.", edit_call(tools, fix, cwd))
    if step == 3:
        return turn("Run the tests.", shell_call(tools, "python3 -m pytest -q"))
    return turn("The tests ran.", text=f"I edited {fix.path} to fix the bug.")


@dataclass
class Demonstrator:
    """The reply function (`ScriptedEngine(tokenizer, Demonstrator(tasks))`): the next turn for a prompt.

    tasks: the tasks it may be given; each is found by its `key` field's text in the prompt. A task with an `expression`
    is arithmetic, one with `files` and a `reference_patch` is SWE-style. A prompt with no known task or no known
    shell tool gets a plain answer saying so."""

    tasks: list[dict[str, Any]]
    key: str = "question"
    mistakes: Mistakes = field(default_factory=Mistakes)

    def __post_init__(self):
        self._by_text = {str(t[self.key]).strip(): t for t in self.tasks}

    def task(self, prompt: Prompt) -> dict[str, Any] | None:
        text = prompt.task_text
        if text in self._by_text:
            return self._by_text[text]
        last = prompt.users[-1] if prompt.users else ""
        return next((t for key, t in self._by_text.items() if key and key in last), None)

    def __call__(self, text: str, spec: SamplingSpec) -> str:
        prompt = read_prompt(text)
        tools, task = toolset(prompt), self.task(prompt)
        if tools is None or task is None:
            return turn("I do not know this task.", text="I cannot help with that.")
        rng = random.Random(spec.seed if spec.seed is not None else zlib.crc32(text.encode()))
        if "expression" in task:
            return arithmetic(prompt, tools, task, rng, self.mistakes)
        return swe(prompt, tools, task, rng, self.mistakes)
