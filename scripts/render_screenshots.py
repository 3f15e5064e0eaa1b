"""Render docs/img/alignment.png and docs/img/dashboard.png from a real run (needs a `chromium` binary).

A Lab on the shipped model; a five-turn calculator session shown in the token alignment view with the
trainer's (transformers fp32) logprobs; the dashboard (its table, its plots and their caption, as the widget
shows them) at the end of a real 2-step GRPO run on the calculator tasks.

    python scripts/render_screenshots.py
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from polar_lab import Lab
from polar_lab.grpo import GRPOConfig, GRPOTrainer
from polar_lab.harness.chain_breakers import multi_turn_agent
from polar_lab.trajectory.fidelity import recompute_logprobs
from polar_lab.viz.alignment import alignment_html

OUT = Path("docs/img")


def screenshot(page: str, name: str, size: str) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        raise SystemExit("no chromium on PATH (Debian: apt-get install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "page.html"
        src.write_text(f"<html><body style='margin:12px;background:white'>{page}</body></html>")
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--window-size={size}", f"--screenshot={(OUT / name).resolve()}", src.as_uri()],
                       check=True, capture_output=True, timeout=120)
    print("wrote", OUT / name)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with Lab("data/models/tiny-calc", port=0, run_name=time.strftime("screenshots-%Y%m%d-%H%M%S")) as lab:
        s = lab.session(harness="multi_turn")
        lab.run(multi_turn_agent(s, ["What is 12*7?", "And 99-13?"], turns=3))
        s.close(reward=1.0)
        (traj,) = lab.trajectories(session_ids=[s.id])
        model = AutoModelForCausalLM.from_pretrained("data/models/tiny-calc", dtype=torch.float32).eval()
        trainer = recompute_logprobs(model, traj, traj.temperature)
        screenshot(alignment_html(traj, lab.tokenizer, trainer_logprobs=trainer, top_k=5), "alignment.png",
                   "1100,900")

        board = lab.dashboard(interval=0.5)  # refreshing in its thread while the trainer steps
        with tempfile.TemporaryDirectory() as out, \
                GRPOTrainer(lab, GRPOConfig(tasks_per_step=4, num_generations=8, output_dir=out)) as trainer:
            trainer.train(2, progress=False)
            board.redraw()
        png = base64.b64encode(bytes(board.image.value)).decode()
        page = f'{board.table.value}<img src="data:image/png;base64,{png}" width="960">{board.caption.value}'
        screenshot(page, "dashboard.png", "990,640")


if __name__ == "__main__":
    main()
