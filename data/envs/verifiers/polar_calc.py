"""polar_lab's calculator task as a verifiers (0.4, `verifiers.v1`) taskset — run by polar_lab.envs.verifiers in
verifiers' own venv (`make verifiers`), never imported by the Lab.

The tasks are data/tasks/calc_train.jsonl (the questions tiny-calc was trained on), with polar_lab's system
prompt; the tool is a `calculator(expression)` MCP tool on one shared server; the reward (`correct`) is 1.0 when
the last assistant message holds the answer. verifiers loads a taskset by module name: this folder must be on
PYTHONPATH (its tool server is started as `python -m polar_calc`).
"""

import ast
import json
import operator
import os
import re
from pathlib import Path

import verifiers.v1 as vf

TASKS = Path(os.environ.get("POLAR_CALC_TASKS", Path(__file__).resolve().parents[2] / "tasks" / "calc_train.jsonl"))
LIMIT = int(os.environ.get("POLAR_CALC_LIMIT", "64"))
SYSTEM_PROMPT = "You are a careful assistant. Use the calculator tool for arithmetic."  # polar_lab's, verbatim
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only integers, +, - and * are allowed")


class CalcData(vf.TaskData):
    answer: int


class CalcToolset(vf.Toolset[vf.SharedToolsetConfig, vf.State]):
    TOOL_PREFIX = None  # the tool is `calculator`, as polar_lab's (not `calc_toolset_calculator`)

    @vf.tool
    async def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression."""
        try:
            return str(_eval(ast.parse(expression, mode="eval")))
        except (ValueError, SyntaxError, RecursionError) as exc:
            return f"error: {exc}"


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        replies = [m for m in trace.messages if m.role == "assistant"]
        text = vf.types.content_text(replies[-1].content) if replies else ""
        return 1.0 if str(task.answer) in re.findall(r"-?\d+", text or "") else 0.0


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        for line in TASKS.read_text().splitlines()[:LIMIT]:
            row = json.loads(line)
            yield CalcTask(CalcData(id=row["id"], prompt=row["question"], system_prompt=SYSTEM_PROMPT,
                                    answer=row["answer"]), self.config.task)

    @classmethod
    def toolsets(cls, config: vf.TasksetConfig) -> list[vf.Toolset]:
        return [CalcToolset(vf.SharedToolsetConfig())]


__all__ = ["CalcTaskset"]

if __name__ == "__main__":  # the tool server's process
    CalcToolset.run()
