"""Named mutants of issue 43's formulas: each drops or changes one term, and the test that names the formula must
fail on it. A fast, targeted complement to `make mutants` (mutmut over the whole core).

Each mutant is applied to a copy of the package in a temporary folder (the working tree is never touched), and the
named test file runs there. Prints one row per mutant — killed (the test failed, as it must) or SURVIVED — and
exits 1 if any survived.

    python scripts/formula_mutants.py [--only NAME,NAME]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name → (file, the text to change (exactly once), what it becomes, the test that must fail)
MUTANTS = {
    "TIS: no truncation": (
        "polar_lab/grpo/loss.py", "ratio.clamp(min=low, max=high)", "ratio", "tests/grpo/test_loss.py"),
    "mask modes: nothing zeroed": (
        "polar_lab/grpo/loss.py", "ratio.masked_fill(out, 0.0)", "ratio", "tests/grpo/test_loss.py"),
    "MIS: mean instead of product": (
        "polar_lab/grpo/loss.py", "log_is = _per_sequence(log_is, trained, mean=False)",
        "log_is = _per_sequence(log_is, trained, mean=True)", "tests/grpo/test_loss.py"),
    "geometric mask: product instead of mean": (
        "polar_lab/grpo/loss.py",
        'elif mode == "geometric_mask":\n        log_is = _per_sequence(log_is, trained, mean=True)',
        'elif mode == "geometric_mask":\n        log_is = _per_sequence(log_is, trained, mean=False)',
        "tests/grpo/test_loss.py"),
    "GSPO: token ratios": (
        "polar_lab/grpo/loss.py", 'if config.importance_sampling_level == "sequence":', "if False:",
        "tests/grpo/test_loss.py"),
    "CISPO: gradient through the weight": (
        "polar_lab/grpo/loss.py", "ratio.clamp(max=config.epsilon_high).detach()",
        "ratio.clamp(max=config.epsilon_high)", "tests/grpo/test_loss.py"),
    "CISPO: no cap": (
        "polar_lab/grpo/loss.py", "ratio.clamp(max=config.epsilon_high).detach()", "ratio.detach()",
        "tests/grpo/test_loss.py"),
    "mismatch KL: k1 instead of k3": (
        "polar_lab/grpo/loss.py", "(log_is.exp() - 1 - log_is)[trained]", "(-log_is)[trained]",
        "tests/grpo/test_loss.py"),
    "distillation: no teacher term": (
        "polar_lab/grpo/loss.py", "adv = adv - config.distill_coef * reverse_kl", "adv = adv",
        "tests/grpo/test_loss.py"),
    "overlong: no punishment": (
        "polar_lab/grpo/batch.py", "(start - length) / config.overlong_buffer_len", "0.0", "tests/grpo/test_batch.py"),
    "dynamic sampling: nothing filtered": (
        "polar_lab/grpo/rollouts.py", "kept, filtered, rounds = [g for g in groups if informative(g)]",
        "kept, filtered, rounds = list(groups)", "tests/grpo/test_rollouts.py"),
    "support: no top_p": (
        "polar_lab/trajectory/support.py", "ascending.masked_fill(cut, float(\"-inf\"))", "ascending",
        "tests/trajectory/test_support.py"),
    "support: no top_k": (
        "polar_lab/trajectory/support.py", "ascending < ascending.gather(-1, (width - k)[:, None])",
        "ascending < float(\"-inf\")", "tests/trajectory/test_support.py"),
    "support: no min_p": (
        "polar_lab/trajectory/support.py", "probs < probs.amax(-1, keepdim=True) * min_p[:, None]",
        "probs < 0", "tests/trajectory/test_support.py"),
    "retry orphans: delivered answers too": (
        "polar_lab/trajectory/builders.py", "if not delivered and index < call.call_index",
        "if index < call.call_index", "tests/trajectory/test_builders.py"),
    "retry orphans: never": (
        "polar_lab/trajectory/builders.py", "if not delivered and index < call.call_index",
        "if False and index < call.call_index", "tests/trajectory/test_builders.py"),
}


def run(name: str, file: str, old: str, new: str, test: str) -> bool:
    """True when the test killed the mutant."""
    with tempfile.TemporaryDirectory(prefix="polar-lab-mutant-") as tmp:
        for part in ("polar_lab", "tests"):
            shutil.copytree(ROOT / part, Path(tmp, part), ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", tmp)
        os.symlink(ROOT / "data", Path(tmp, "data"))
        target = Path(tmp, file)
        text = target.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"{name}: the text to change occurs {text.count(old)} times in {file}")
        target.write_text(text.replace(old, new))
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
                                 "--no-header", "-o", "addopts=", test], cwd=tmp, capture_output=True, text=True)
        return result.returncode != 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated mutant names")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(MUTANTS)
    survived = []
    for name in names:
        killed = run(name, *MUTANTS[name])
        print(f"{'killed  ' if killed else 'SURVIVED'}  {name}  ({MUTANTS[name][3]})", flush=True)
        if not killed:
            survived.append(name)
    print(f"{len(names) - len(survived)} of {len(names)} killed")
    sys.exit(1 if survived else 0)


if __name__ == "__main__":
    main()
