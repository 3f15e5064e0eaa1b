"""What the isolated sandbox costs each run: start-up at the "isolated" level (bwrap's namespaces, mounts, seccomp,
a leased uid) against "process", for a bare run, each preset's program and a whole calculator-CLI run.

Three measures, each at both levels, the levels interleaved so machine drift hits both alike:
1. a bare run (`true`): the sandbox's own cost — cgroups, prlimit, and for "isolated" bwrap, setpriv, the
   namespaces and mounts;
2. each preset's program start-up, no model call (`--version`/`--help`: Claude Code, Codex CLI,
   mini-swe-agent, the calculator CLI's interpreter with its imports);
3. a whole calculator-CLI run through `lab.rollout` on the real engine (two model calls, through the
   forwarder when isolated), at concurrency 1.
Printed: the median over the repeats, and isolated − process.

    python benchmarks/sandbox_startup.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from polar_lab import Lab, sandbox
from polar_lab.harness.command import Command
from polar_lab.harness.presets import agents_bin, install_root
from polar_lab.tasks import load_tasks

from result import save

LEVELS = ("process", "isolated")


def programs() -> dict[str, tuple[list[str], list[str], int]]:
    """name → (argv, read-only paths, memory MiB) for each preset's program start-up."""
    out = {"bare (true)": (["true"], [], 512),
           "calc CLI (python, imports)": ([sys.executable, "-c", "import openai, polar_lab.harness.calc_cli"], [], 4096),
           "mini-swe-agent (--help)": ([f"{sys.prefix}/bin/mini", "--help"], [], 4096)}
    for name, label in (("claude", "Claude Code (--version)"), ("codex", "Codex CLI (--version)")):
        try:
            executable = agents_bin(name)
        except FileNotFoundError:
            print(f"{label}: not installed (make agents), skipped")
            continue
        out[label] = ([executable, "--version"], [install_root(executable)], 16384)
    return out


def time_program(argv: list[str], readonly: list[str], memory_mb: int, level: str) -> float:
    limits = sandbox.Limits(memory_mb=memory_mb)
    with sandbox.workdir() as where:
        t0 = time.perf_counter()
        box = sandbox.Sandbox(argv, workdir=where, env=sandbox.environment(where), limits=limits, level=level,
                              readonly=tuple(readonly))
        outcome = box.start().wait(120)
        took = time.perf_counter() - t0
    if outcome.returncode != 0:
        raise SystemExit(f"{argv[0]} failed at {level}: {outcome.stderr[-500:]}")
    return took


def report(name: str, times: dict[str, list[float]]) -> list:
    """Print the medians at both levels and the difference; the same as a table row."""
    p, i = (statistics.median(times[level]) * 1000 for level in LEVELS)
    print(f"{name:34s} process {p:8.1f} ms   isolated {i:8.1f} ms   added {i - p:+7.1f} ms")
    return [name, round(p, 1), round(i, 1), f"{i - p:+.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(f"isolated level here: {sandbox.unavailable() or 'available'}; repeats: {args.repeats}")
    rows = []
    for name, (argv, readonly, memory_mb) in programs().items():
        times = {level: [] for level in LEVELS}
        time_program(argv, readonly, memory_mb, "isolated")  # warm the page cache for both
        for _ in range(args.repeats):
            for level in LEVELS:
                times[level].append(time_program(argv, readonly, memory_mb, level))
        rows.append(report(name, times))
    with tempfile.TemporaryDirectory() as runs, Lab(port=0, runs_dir=runs) as lab:
        task = load_tasks("data/tasks/calc_test.jsonl", 1)
        times = {level: [] for level in LEVELS}
        for _ in range(args.repeats):
            for level in LEVELS:
                cli = Command(["{python}", "-m", "polar_lab.harness.calc_cli", "{question}"], name="calc_cli",
                              sandbox=level)
                t0 = time.perf_counter()
                (g,) = lab.rollout(task, cli, num_generations=1, progress=False, sampling={"seed": 0})
                times[level].append(time.perf_counter() - t0)
                assert g.sessions[0].status == "closed", g.sessions[0].info
        rows.append(report("calc CLI run, 2 model calls", times))
    save("sandbox_startup", {f"added by isolation, {row[0]} (ms)": row[3] for row in (rows[0], rows[-1])},
         tables=[{"title": f"Median of {args.repeats} runs per level, the levels interleaved",
                  "columns": ["run", "process (ms)", "isolated (ms)", "added (ms)"], "rows": rows}],
         title="The isolated sandbox's start-up cost", raw={"repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
