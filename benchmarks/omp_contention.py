"""Two OpenMP pools on the same cores: the wall time of a training loop alone and beside a copy of itself, under
libgomp's default wait policy (a waiting thread spins) and under OMP_WAIT_POLICY=PASSIVE (it sleeps).

torch on CPU runs its ops on a libgomp thread pool as wide as the machine. When two such processes share the cores
(two pytest workers, an engine stepping beside an in-kernel trainer), each one's threads spin while they wait for a
partner the other process has descheduled. The suite sets PASSIVE for every process it starts (tests/conftest.py).

Each trial is a fresh process (libgomp reads the policy once, when it loads): `--steps` forward/backward/AdamW steps
of the shipped tiny model on a (16, 256) batch, with torch's default thread count.

    python benchmarks/omp_contention.py [--steps 12] [--model data/models/tiny-calc]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from result import save

LOOP = """
import sys, time, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
batch = torch.randint(0, model.config.vocab_size, (16, 256))
start = time.perf_counter()
for _ in range(int(sys.argv[2])):
    model(batch).logits.log_softmax(-1).mean().backward()
    opt.step()
    opt.zero_grad()
print(time.perf_counter() - start, torch.get_num_threads())
"""


def trial(model: str, steps: int, policy: str | None, copies: int) -> list[tuple[float, int]]:
    """Start `copies` loops at once under `policy` (None: libgomp's default); each one's wall seconds and threads."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    procs = [subprocess.Popen([sys.executable, "-c", LOOP, model, str(steps)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(copies)]
    out = [p.communicate()[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs), "a training loop failed"
    return [(float(wall), int(threads)) for wall, threads in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="data/models/tiny-calc")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; {args.steps} steps of a (16, 256) batch on {args.model}")
    print(f"{'policy':<10}{'copies':>7}{'threads':>9}{'wall per copy (s)':>20}")
    results = []
    for policy in (None, "PASSIVE"):
        for copies in (1, 2):
            start = time.perf_counter()
            runs = trial(args.model, args.steps, policy, copies)
            walls = ", ".join(f"{wall:.1f}" for wall, _ in runs)
            print(f"{policy or 'default':<10}{copies:>7}{runs[0][1]:>9}{walls:>20}   ({time.perf_counter() - start:.0f} s)")
            results.append({"policy": policy or "unset (libgomp spins)", "copies": copies, "walls": walls})
    save("omp_contention", {f"{r['policy']}, {r['copies']} at once, each (s)": r["walls"] for r in results},
         notes=[f"{args.steps} steps of a (16, 256) batch on {args.model}, {os.cpu_count()} cores"],
         title="OpenMP's wait policy: a spinning pool starves its neighbours",
         raw={"steps": args.steps, "model": args.model, "runs": results})


if __name__ == "__main__":
    main()
