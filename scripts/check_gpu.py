"""The GPU check for the paper's setup: one script, one table, a few minutes on one H100 or H200.

    python scripts/check_gpu.py [--json PATH]      # on a GPU machine (docs/scale.md: how to read each row)
    python scripts/check_gpu.py --cpu-rehearsal    # developers: the same code on CPU, small sizes, no 4B model

On a machine without CUDA it refuses in one line and exits 2. Otherwise every row prints as it finishes (PASS, FAIL or
SKIP with its figure) and the whole table at the end; exit 1 if a row failed. `--only sync,memory` runs a subset. Rows:
  engine    vLLM on CUDA: the hybrid fixture and SmolLM2 up, one chat call each, start seconds (SKIP where vLLM is
            not installed: its CUDA wheel is not on every GPU machine)
  fidelity  the trainer (bf16 autocast on the GPU) against fp32 on CPU, at T=0.7, on every sampled token of the
            hybrid fixture (tiny-calc-qwen35-hybrid, Qwen3_5ForCausalLM) and tiny-calc; the TIS weight it gives
  fsdp      FSDP2 with bf16 mixed precision (2 ranks where 2 GPUs exist, else 1) on the hybrid fixture: logprobs at
            T=0.7 (the temperature must stay fp32), one update whose gradients match one unsharded rank
  lora      the hybrid fixture with adapters on attention, DeltaNet and MLP projections: only the adapter moves,
            the merged weights as shipped score like the trainer
  offload   FSDP2 with cpu_offload=True on one GPU (shards and optimiser state in host memory): the same update as one
            unsharded rank with a lower GPU peak, and its time beside FSDP without offload
  sync      the weights as the file path ships them (fp32 safetensors) and as the in-memory path writes them (a
            Lab-style slot in bf16, fresh and again in place, read back bit for bit): seconds and GiB per model, 4B
            included
  memory    Qwen3.5-4B's config (configs/qwen3.5-4b, random weights): the trainer's measured peak on one GPU against
            polar_lab/grpo/memory.py's plan for the same update
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's polar_lab, even uninstalled
sys.path.insert(0, str(ROOT / "scripts"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from check_cuda_trainer import make_samples, mean_abs_gap, reference_logprobs, relative_gap  # noqa: E402

from polar_lab.grpo.batch import Sample  # noqa: E402
from polar_lab.grpo.config import GRPOConfig  # noqa: E402
from polar_lab.grpo.policy import Policy  # noqa: E402

HYBRID = "data/models/tiny-calc-qwen35-hybrid"
TINY = "data/models/tiny-calc"
SMOLLM2 = "data/models/smollm2-135m-instruct"
QWEN35_4B = "configs/qwen3.5-4b"
TEMPERATURE = 0.7
FIDELITY = {"mean": 2e-2, "max": 0.25, "tis": 2e-2}  # bf16 autocast against fp32: tolerances, not goals
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj",
                "up_proj", "down_proj"]


class Table:
    """Rows as they finish, printed at once (a run cut off by its time limit still shows what it got)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(self, check: str, model: str, status: str, figure: str, **numbers) -> None:
        self.rows.append(dict(check=check, model=model, status=status, figure=figure, **numbers))
        print(f"{status:4s} {check:9s} {model:28s} {figure}", flush=True)

    def render(self) -> str:
        lines = [f"{'':4s} {'check':9s} {'model':28s} figure", "-" * 110]
        lines += [f"{r['status']:4s} {r['check']:9s} {r['model']:28s} {r['figure']}" for r in self.rows]
        return "\n".join(lines)

    @property
    def failed(self) -> int:
        return sum(r["status"] == "FAIL" for r in self.rows)


@contextlib.contextmanager
def guarded(table: Table, check: str, model: str):
    """One row's crash is that row's FAIL, and the next rows still run."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - reported in the table, the check goes on
        table.add(check, model, "FAIL", f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def tis_mean(trainer: list[torch.Tensor], reference: list[torch.Tensor], samples: list[Sample]) -> float:
    ratios = torch.cat([(t.float() - r.float()).exp()[s.weights > 0] for t, r, s in zip(trainer, reference, samples)])
    return float(ratios.mean())


def fidelity(args, table: Table, model: str) -> list[Sample]:
    """The trainer at bf16 on the device against fp32 on CPU, T=0.7: |Δ logprob| and the TIS weight."""
    samples = make_samples(model, args.device, args.new_tokens, args.seed, temperature=TEMPERATURE)
    reference, _ = reference_logprobs(model, samples)
    for s, lp in zip(samples, reference):
        s.behavior_logprobs = lp.clone()  # the engine's logprobs stand in as fp32 CPU recomputation
    policy = Policy(model, GRPOConfig(dtype=args.dtype, device=args.device, micro_batch_size=4), device=args.device)
    trainer = policy.logprobs(samples)
    mean, worst = mean_abs_gap(trainer, reference, samples)
    tis = tis_mean(trainer, reference, samples)
    tokens = sum(s.num_tokens for s in samples)
    ok = mean <= FIDELITY["mean"] and worst <= FIDELITY["max"] and abs(tis - 1) <= FIDELITY["tis"]
    table.add("fidelity", Path(model).name, "PASS" if ok else "FAIL",
              f"{args.dtype} {args.device} vs fp32 cpu, T={TEMPERATURE}, {tokens} tokens: mean |Δ| {mean:.2e}, "
              f"max {worst:.2e}, TIS mean {tis:.4f}", mean=mean, max=worst, tis=tis, tokens=tokens)
    return samples


def trainer_settings(args) -> dict:
    """The update the fsdp and offload rows compare with one unsharded rank."""
    return dict(learning_rate=1e-3, dtype=args.dtype, device=args.device, micro_batch_size=4)


def one_rank(args, model: str, samples: list[Sample]) -> tuple[list[torch.Tensor], dict]:
    """One unsharded rank's logprobs of `samples` before the update, and its gradients of the update."""
    single = Policy(model, GRPOConfig(**trainer_settings(args)), device=args.device)
    logprobs = single.logprobs(samples)
    single.update(samples)
    return logprobs, single.gradients()


def fsdp(args, table: Table, model: str, samples: list[Sample]) -> None:
    """FSDP2 bf16 mixed precision: logprobs at T=0.7 against one unsharded rank's, and the same gradients."""
    from polar_lab.grpo.distributed import DistributedPolicy

    ranks = min(2, torch.cuda.device_count()) if args.device == "cuda" else 2
    devices = [f"cuda:{r}" for r in range(ranks)] if args.device == "cuda" else ["cpu"] * ranks
    base = trainer_settings(args)
    single_lp, grads = one_rank(args, model, samples)
    sharded = DistributedPolicy(model, GRPOConfig(**base, world_size=ranks, strategy="fsdp", trainer_devices=devices))
    try:
        lp = sharded.logprobs(samples)
        stats = sharded.update(samples)
        other = sharded.gradients()
    finally:
        sharded.close()
    mean, worst = mean_abs_gap(lp, single_lp, samples)
    tis = tis_mean(lp, [s.behavior_logprobs for s in samples], samples)
    gap = relative_gap(grads, other)
    ok = mean <= FIDELITY["mean"] and gap <= 5e-2 and math.isfinite(stats.loss)
    table.add("fsdp", f"{Path(model).name} ×{ranks}", "PASS" if ok else "FAIL",
              f"bf16 mixed precision, T={TEMPERATURE}: logprobs vs 1 rank mean |Δ| {mean:.2e} (max {worst:.2e}), TIS "
              f"vs fp32 {tis:.4f}, relative gradient gap {gap:.2e}, loss {stats.loss:.4f}", mean=mean, tis=tis,
              grad_gap=gap, ranks=ranks)


def offload(args, table: Table, model: str, samples: list[Sample]) -> None:
    """FSDP2 with `cpu_offload=True` (shards and optimiser state in host memory, gloo for the CPU side): the same
    update as one unsharded rank, a lower GPU peak over it than without offload, and its time beside that."""
    from polar_lab.grpo.distributed import DistributedPolicy

    base = trainer_settings(args)
    single_lp, grads = one_rank(args, model, samples)
    seconds, out, peak = {}, {}, {}
    for offloaded in (False, True):
        sharded = DistributedPolicy(model, GRPOConfig(**base, world_size=1, strategy="fsdp", cpu_offload=offloaded,
                                                      trainer_devices=[f"{args.device}:0"]))
        try:
            lp = sharded.logprobs(samples)
            sharded.memory(reset_peak=True)
            t0 = time.perf_counter()
            stats = sharded.update(samples)
            seconds[offloaded] = time.perf_counter() - t0
            peak[offloaded] = sharded.memory()[0]["cuda_peak"]  # the GPU's peak over the update, the rank's view
            out[offloaded] = (lp, stats, sharded.gradients())
        finally:
            sharded.close()
    lp, stats, other = out[True]
    mean, worst = mean_abs_gap(lp, single_lp, samples)
    gap = relative_gap(grads, other)
    # the shards, their gradients and Adam's state off the GPU: its peak over an update must drop
    ok = mean <= FIDELITY["mean"] and gap <= 5e-2 and math.isfinite(stats.loss) and peak[True] < peak[False]
    table.add("offload", f"{Path(model).name} ×1", "PASS" if ok else "FAIL",
              f"fsdp cpu_offload: logprobs vs 1 rank mean |Δ| {mean:.2e} (max {worst:.2e}), relative gradient gap "
              f"{gap:.2e}, loss {stats.loss:.4f}; GPU peak over the update {peak[True] / 2**20:.0f} MiB (without "
              f"offload {peak[False] / 2**20:.0f} MiB); update {seconds[True]:.2f} s (without {seconds[False]:.2f} s)",
              mean=mean, grad_gap=gap, update_s=seconds[True], update_s_without=seconds[False],
              cuda_peak=peak[True], cuda_peak_without=peak[False])


def lora(args, table: Table, model: str, samples: list[Sample]) -> None:
    from polar_lab.engine.weights import read_weights

    config = GRPOConfig(learning_rate=1e-2, dtype=args.dtype, device=args.device, micro_batch_size=4,
                        peft_config={"r": 8, "lora_alpha": 16, "target_modules": LORA_TARGETS})
    policy = Policy(model, config, device=args.device)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    policy.update(samples)
    policy.update(samples)  # B starts at 0: the second step moves A too
    moved = {n for n, p in policy.model.named_parameters() if not torch.equal(before[n], p)}
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in moved}
    shipped = Policy(model, GRPOConfig(dtype="float32", device="cpu"), device="cpu")
    with tempfile.TemporaryDirectory() as folder:
        policy.write_weights(f"{folder}/merged.safetensors")
        shipped.load_state_dict(dict(read_weights(f"{folder}/merged.safetensors")))
    mean, worst = mean_abs_gap(policy.logprobs(samples), shipped.logprobs(samples), samples)
    only_adapter = bool(moved) and all(".lora_" in n for n in moved)
    ok = only_adapter and mean <= FIDELITY["mean"] and {"in_proj_qkv", "q_proj"} <= adapted
    table.add("lora", Path(model).name, "PASS" if ok else "FAIL",
              f"{len(moved)} tensors moved ({'all adapter' if only_adapter else 'NOT all adapter'}; layers "
              f"{','.join(sorted(adapted))}); merged as shipped vs trainer mean |Δ| {mean:.2e}, max {worst:.2e}")


def random_model(config_path: str, folder: str, device: str):
    """A model with random weights from a config alone (no checkpoint travels to the GPU machine), saved in bf16."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(config_path)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    try:
        AutoTokenizer.from_pretrained(config_path).save_pretrained(folder)
    except Exception:  # noqa: BLE001 - a config without a tokenizer: the trainer needs none for these rows
        pass
    del model
    return folder


def write_time(policy, scratch: str) -> tuple[float, float]:
    """Seconds and GiB of the weights file a sync writes, in /dev/shm as the sync does where it has room (else in
    `scratch`); the file is removed after."""
    with tempfile.TemporaryDirectory(dir=shm_or(scratch, 4 * params(policy))) as folder:
        t0 = time.perf_counter()
        written = policy.write_weights(f"{folder}/sync.safetensors")
        return time.perf_counter() - t0, written / 2**30


def slot_write_time(policy, scratch: str) -> tuple[float, float, float, list[str]]:
    """The in-memory path (issue 45): the weights written into a Lab-style slot in the engine's dtype (bf16 on a
    GPU), first into a fresh slot, then again in place as every later sync does; then read back and compared with
    the trainer's tensors cast on the CPU, bit for bit. (first s, again s, GiB, names that differ)."""
    from polar_lab.engine.weights import SLOT_PREFIX, read_weights, unmap, wire_dtype

    with tempfile.TemporaryDirectory(dir=shm_or(scratch, 2 * params(policy))) as folder:
        path = f"{folder}/{SLOT_PREFIX}0.safetensors"
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            written = policy.write_weights(path, torch.bfloat16)
            times.append(time.perf_counter() - t0)
        state = policy.model.state_dict()
        differ = []
        for name, got in read_weights(path):
            want = state[name].detach().cpu()
            if not torch.equal(got, want.to(wire_dtype(want.dtype, want.shape, torch.bfloat16))):
                differ.append(name)
        unmap(path)
        return times[0], times[1], written / 2**30, differ


def params(policy) -> int:
    return sum(p.numel() for p in policy.model.parameters())


def shm_or(scratch: str, size: int) -> str:
    """/dev/shm where it has room for `size` bytes (and a margin), else `scratch`."""
    import shutil

    try:
        return "/dev/shm" if shutil.disk_usage("/dev/shm").free > 1.2 * size else scratch
    except OSError:
        return scratch


def add_sync_rows(table: Table, model: str, policy, scratch: str) -> None:
    seconds, gib = write_time(policy, scratch)
    table.add("sync", model, "PASS", f"file path: write {seconds:.2f} s, {gib:.2f} GiB fp32", seconds=seconds, gib=gib)
    first, again, gib, differ = slot_write_time(policy, scratch)
    table.add("sync", model, "FAIL" if differ else "PASS",
              f"in memory (slot, bf16): write {first:.2f} s into a fresh slot, {again:.2f} s in place, {gib:.2f} GiB; "
              f"read back: {f'{len(differ)} tensors differ, e.g. {differ[:2]}' if differ else 'every tensor as cast on the CPU'}"
              f" (the engine's side needs vLLM: the engine row)", first_s=first, again_s=again, gib=gib,
              differ=len(differ))


def sync_rows(args, table: Table, scratch: str) -> None:
    """What a sync writes, per model: the file path (fp32 safetensors the engine parses) and the in-memory slot."""
    models = [HYBRID]
    if (ROOT / SMOLLM2 / "config.json").exists():
        models.append(SMOLLM2 if (ROOT / SMOLLM2 / "model.safetensors").exists()
                      else random_model(str(ROOT / SMOLLM2), f"{scratch}/smollm2", args.device))
    for model in models:
        with guarded(table, "sync", Path(model).name):
            policy = Policy(model, GRPOConfig(dtype=args.dtype, device=args.device), device=args.device)
            add_sync_rows(table, "smollm2-135m" if "smollm2" in model else Path(model).name, policy, scratch)


def memory(args, table: Table, scratch: str) -> None:
    """Qwen3.5-4B (random weights), one bf16 update on one GPU: the measured peak against the plan, without activation
    checkpointing at `--memory-tokens` and with it at 4× as many (the recipe's setting)."""
    from transformers import AutoConfig

    from polar_lab.grpo.memory import GIB, ModelShape, plan

    folder = qwen35_4b(args, scratch)
    shape = ModelShape.from_config(AutoConfig.from_pretrained(folder))
    capacity = torch.cuda.get_device_properties(0).total_memory
    policy = None
    for checkpointing, tokens in ((False, args.memory_tokens), (True, 4 * args.memory_tokens)):
        asked = tokens
        while tokens > 512 and 1.25 * plan(shape, strategy="ddp", tokens=tokens, chunk=4096, attention="flash",
                                           checkpointing=checkpointing)["trainer_total"] > capacity:
            tokens //= 2  # the plan, at the row's own tolerance, does not fit this GPU (an H100 at 4,096 unchecked)
        policy = None
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        policy = Policy(folder, GRPOConfig(dtype=args.dtype, device=args.device, micro_batch_size=1,
                                           logprob_chunk_tokens=4096, gradient_checkpointing=checkpointing),
                        device=args.device)
        load_s = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        stats = policy.update([token_sample(tokens)])
        sync(args.device)
        step_s = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated()
        predicted = plan(shape, strategy="ddp", tokens=tokens, chunk=4096, attention="flash",
                         checkpointing=checkpointing)["trainer_total"]
        ratio = peak / predicted
        table.add("memory", "qwen3.5-4b (random weights)", "PASS" if 0.75 <= ratio <= 1.25 and
                  math.isfinite(stats.loss) else "FAIL",
                  f"{shape.params / 1e9:.2f}B params, {tokens} tokens, {'' if checkpointing else 'no '}checkpointing: "
                  f"measured peak {peak / GIB:.1f} GiB, plan {predicted / GIB:.1f} GiB (×{ratio:.2f}); "
                  f"load {load_s:.0f} s, update {step_s:.1f} s"
                  + (f" ({asked} tokens planned past this GPU's {capacity / GIB:.0f} GiB)" if tokens != asked else ""),
                  peak_gib=peak / GIB, plan_gib=predicted / GIB,
                  tokens=tokens, checkpointing=checkpointing)


def qwen35_4b(args, scratch: str) -> str:
    """Qwen3.5-4B's shape with random weights, saved once per run in `scratch`."""
    folder = f"{scratch}/qwen35-4b"
    return folder if Path(folder, "config.json").exists() else random_model(str(ROOT / QWEN35_4B), folder, args.device)


def sync_4b(args, table: Table, scratch: str) -> None:
    """The sync rows for Qwen3.5-4B's shape (random weights), the size where the write's path matters."""
    folder = qwen35_4b(args, scratch)
    policy = Policy(folder, GRPOConfig(dtype=args.dtype, device=args.device), device=args.device)
    add_sync_rows(table, "qwen3.5-4b (random weights)", policy, scratch)


def token_sample(tokens: int) -> Sample:
    """One sequence of random ids, every target trained, at T=0.7."""
    torch.manual_seed(0)
    n = tokens - 1
    return Sample(input_ids=torch.randint(0, 240_000, (tokens,)), weights=torch.full((n,), 1.0 / n), advantage=1.0,
                  behavior_logprobs=torch.full((n,), -12.0), versions=torch.zeros(n, dtype=torch.long),
                  temperature=TEMPERATURE)


def engine_rows(args, table: Table) -> None:
    """vLLM on CUDA: each model up through a Lab, one chat call, the start time."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        table.add("engine", "hybrid fixture, smollm2", "SKIP", "vLLM is not installed on this machine")
        return
    import openai

    from polar_lab import Lab

    for model in (HYBRID, SMOLLM2):
        if not (ROOT / model / "model.safetensors").exists():
            table.add("engine", Path(model).name, "SKIP", "no weights here (make smollm2 writes them)")
            continue
        with guarded(table, "engine", Path(model).name):
            t0 = time.perf_counter()
            with Lab(str(ROOT / model), port=0, device="cuda", max_model_len=4096) as lab:
                up = time.perf_counter() - t0
                s = lab.session(sampling={"temperature": TEMPERATURE})
                client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.api_key, max_retries=0)
                reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+3?"}],
                                                       max_tokens=32)
                calls = lab.call_records([s.id])
            table.add("engine", Path(model).name, "PASS" if calls and reply.choices else "FAIL",
                      f"up in {up:.1f} s on CUDA, {len(calls)} call recorded, {reply.usage.completion_tokens} tokens")


ROWS = ("fidelity", "fsdp", "lora", "offload", "sync", "memory", "engine")


def trainer_rows(args, table: Table, want: set[str]) -> None:
    """fidelity on both fixtures; fsdp, lora and offload on the hybrid one, with its fidelity row's samples."""
    for model in (HYBRID, TINY):
        with guarded(table, "fidelity", Path(model).name):
            samples = fidelity(args, table, model)
            if model != HYBRID:
                continue
            for row, check in (("fsdp", fsdp), ("lora", lora), ("offload", offload)):
                if row not in want or (row == "offload" and args.device != "cuda"):
                    continue  # offload moves shards off a GPU; on CPU there is nowhere to move them
                with guarded(table, row, Path(model).name):
                    check(args, table, model, samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-rehearsal", action="store_true", help="run the small rows on CPU (no 4B, no engine)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--memory-tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=",".join(ROWS), help=f"a subset of the rows: {','.join(ROWS)}")
    args = parser.parse_args()
    want = set(args.only.split(","))
    if want - set(ROWS):
        parser.error(f"--only: unknown rows {sorted(want - set(ROWS))}; known: {', '.join(ROWS)}")
    if not torch.cuda.is_available() and not args.cpu_rehearsal:
        print("refused: no CUDA device here (torch.cuda.is_available() is False); run this on a GPU machine, or "
              "--cpu-rehearsal to exercise the code on CPU")
        return 2
    args.device, args.dtype = ("cpu", "bfloat16") if args.cpu_rehearsal else ("cuda", "bfloat16")
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (rehearsal)"
    print(f"torch {torch.__version__}, {where}, {torch.cuda.device_count()} GPUs; rows print as they finish",
          flush=True)
    table, started = Table(), time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        if want & {"fidelity", "fsdp", "lora", "offload"}:
            trainer_rows(args, table, want)
        if "sync" in want:
            sync_rows(args, table, scratch)
        if args.device == "cuda":
            if "sync" in want:
                with guarded(table, "sync", "qwen3.5-4b"):
                    sync_4b(args, table, scratch)
            if "memory" in want:
                with guarded(table, "memory", "qwen3.5-4b"):
                    memory(args, table, scratch)
            if "engine" in want:
                engine_rows(args, table)
    print(f"\n{table.render()}\n{len(table.rows)} rows, {table.failed} failed, {time.perf_counter() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(table.rows, indent=1))
    return 1 if table.failed else 0


if __name__ == "__main__":
    sys.exit(main())
