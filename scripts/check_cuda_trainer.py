"""Check the GRPO trainer's accelerator path on whatever machine this runs on: one short script, needing
only torch, transformers and this checkout (no vLLM, no network, no package installs).

Checks, each printed PASS/FAIL with its figure:
  1. the trainer (`polar_lab.grpo.policy.Policy`, --dtype, --device) scores sampled tokens like the
     engine would: the reference is transformers fp32 on CPU, which equals vLLM's processed logprobs
     within ~3e-6 (tests/engine). Tolerance by dtype: mean |Δ| 1e-4 (fp32), 3e-2 (bf16);
  2. one GRPO update: finite loss and gradient norm, every weight moved;
  3. the updated weights, shipped as the engine would get them (CPU fp32 state dict incl. lm_head),
     score the same tokens like the trainer does (same tolerances);
  4. with --world-size N > 1: N DDP ranks (nccl on GPU, gloo on CPU) make the same update as one rank;
  5. with --world-size N > 1: N FSDP2 ranks compute the same gradients as one unsharded rank (bf16 gathers
     with fp32 reduction on GPU) and write the full weights from their shards;
  6. activation checkpointing gives the same loss and gradients as without;
  7. LoRA (needs peft; SKIP without it): a step moves only the adapter, and the merged weights as shipped
     score like the trainer;
  8. weights through vLLM's own weight-transfer API (needs vLLM with CUDA; SKIP without it): a Lab whose engine
     takes them by NCCL (2+ GPUs: the trainer on the second) or CUDA IPC (one GPU, co-located), then by the
     shared-memory slot; the engine samples the same tokens with the same logprobs after either, and the
     time of each sync (engine/weight_transfer.py; not run on a GPU yet).

    python scripts/check_cuda_trainer.py                       # cuda, bf16, 1 rank
    python scripts/check_cuda_trainer.py --world-size 8        # DDP and FSDP over 8 GPUs (nccl)
    python scripts/check_cuda_trainer.py --device cpu --dtype float32   # the same path on CPU (CI runs this)
Exit status 0 when every check passed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's polar_lab, even uninstalled
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from polar_lab.grpo.batch import Sample  # noqa: E402
from polar_lab.grpo.config import GRPOConfig  # noqa: E402
from polar_lab.grpo.policy import Policy  # noqa: E402

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # mean |Δ logprob| per token
QUESTIONS = ["What is 12*(3+4)?", "Compute 85-17*3.", "What is 406+59?", "Calculate (7+8)*9.",
             "What is 33*21?", "Compute 500-123.", "What is 64+64*2?", "Calculate 19*19."]


def reference_logprobs(model_path: str, samples: list[Sample]) -> tuple[list[torch.Tensor], str]:
    """Per-target logprobs from transformers fp32 on CPU (the engine's numbers, see the module docstring)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            logits = model(s.input_ids[None]).logits[0, :-1] / s.temperature
            out.append(logits.log_softmax(-1).gather(-1, s.input_ids[1:, None])[:, 0])
    return out, "transformers fp32 (CPU)"


def make_samples(model_path: str, device: str, new_tokens: int, seed: int, temperature: float = 1.0) -> list[Sample]:
    """Sample completions of calculator prompts on the device at `temperature`; advantages alternate +1/-1."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polar_lab.harness.calculator import CALC_TOOL, SYSTEM_PROMPT

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    torch.manual_seed(seed)
    samples = []
    for i, question in enumerate(QUESTIONS):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        prompt = tok.apply_chat_template(messages, tools=[CALC_TOOL], add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
        ids = torch.tensor([prompt], device=device)
        full = model.generate(ids, do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                              max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id or 0)[0].cpu()
        n = len(full)
        weights = torch.zeros(n - 1)
        weights[len(prompt) - 1:] = 1.0
        samples.append(Sample(input_ids=full, weights=weights, advantage=1.0 if i % 2 == 0 else -1.0,
                              behavior_logprobs=torch.zeros(n - 1), versions=torch.zeros(n - 1, dtype=torch.long),
                              temperature=temperature, session_id=f"check-{i}"))
    total = sum(float(s.weights.sum()) for s in samples)
    for s in samples:
        s.weights /= total  # token-mean over the batch
    return samples


def mean_abs_gap(a: list[torch.Tensor], b: list[torch.Tensor], samples: list[Sample]) -> tuple[float, float]:
    gaps = torch.cat([(x.float() - y.float()).abs()[s.weights > 0] for x, y, s in zip(a, b, samples)])
    return float(gaps.mean()), float(gaps.max())


def check_ranks(args, samples: list[Sample], start: dict, after: dict, stats: dict, report) -> None:
    """N DDP ranks on the same samples make the same update as the single rank did."""
    from polar_lab.grpo.distributed import DistributedPolicy

    devices = [f"{args.device}:{r}" if args.device == "cuda" else "cpu" for r in range(args.world_size)]
    ranks = DistributedPolicy(args.model, GRPOConfig(learning_rate=1e-3, dtype=args.dtype, device=args.device,
                                                     micro_batch_size=4, world_size=args.world_size,
                                                     trainer_devices=devices))
    try:
        multi = ranks.update(samples)
        other = ranks.state_dict()
    finally:
        ranks.close()
    # Adam's first step is ~lr * sign(grad): rounding flips the sign of near-zero gradients, so compare
    # the total gap to the total step (bf16 rounds far more than fp32)
    gap = sum(float((other[k] - after[k]).abs().sum()) for k in after)
    step = sum(float((after[k] - start[k]).abs().sum()) for k in after)
    limit = {"float32": 1e-3, "bfloat16": 0.1}[args.dtype]
    report(f"{args.world_size} DDP ranks vs 1", gap / step <= limit and abs(multi.loss - stats.loss) < 1e-3,
           f"sum |weight gap| / sum |step| = {gap / step:.2e} (limit {limit}), loss {multi.loss:.4f} vs "
           f"{stats.loss:.4f}")


def relative_gap(a: dict, b: dict) -> float:
    """|a - b| / |a| over all tensors of two same-keyed dicts."""
    num = sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in a)
    return (num / max(sum(float(a[k].float().pow(2).sum()) for k in a), 1e-30)) ** 0.5


GRAD_TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}  # relative gradient gap (bf16 rounds each rank's sums)


def check_fsdp(args, samples: list[Sample], grads: dict, stats, report) -> None:
    """N FSDP2 ranks: the same gradients as one unsharded rank; full weights written from the shards."""
    import tempfile

    from polar_lab.engine.weights import read_weights
    from polar_lab.grpo.distributed import DistributedPolicy

    devices = [f"{args.device}:{r}" if args.device == "cuda" else "cpu" for r in range(args.world_size)]
    ranks = DistributedPolicy(args.model, GRPOConfig(learning_rate=1e-3, dtype=args.dtype, device=args.device,
                                                     micro_batch_size=4, world_size=args.world_size,
                                                     strategy="fsdp", trainer_devices=devices))
    try:
        multi = ranks.update(samples)
        other = ranks.gradients()
        with tempfile.TemporaryDirectory() as folder:
            size = ranks.write_weights(f"{folder}/w.safetensors")
            written = dict(read_weights(f"{folder}/w.safetensors"))
        full = ranks.state_dict()
    finally:
        ranks.close()
    gap = relative_gap(grads, other)
    same_file = set(written) == set(full) and all(torch.equal(written[k], full[k]) for k in full)
    report(f"{args.world_size} FSDP ranks vs 1", gap <= GRAD_TOLERANCE[args.dtype] and same_file,
           f"relative gradient gap {gap:.2e} (limit {GRAD_TOLERANCE[args.dtype]}), loss {multi.loss:.4f} vs "
           f"{stats.loss:.4f}, weights file {size / 2**20:.1f} MiB {'=' if same_file else '!='} gathered state")


def check_checkpointing(args, samples: list[Sample], grads: dict, stats, report) -> None:
    policy = Policy(args.model, GRPOConfig(learning_rate=1e-3, dtype=args.dtype, device=args.device,
                                           micro_batch_size=4, gradient_checkpointing=True), device=args.device)
    again = policy.update(samples)
    gap = relative_gap(grads, policy.gradients())
    report("activation checkpointing", gap <= GRAD_TOLERANCE[args.dtype],
           f"relative gradient gap {gap:.2e}, loss {again.loss:.4f} vs {stats.loss:.4f}")


def check_lora(args, samples: list[Sample], report) -> None:
    try:
        import peft  # noqa: F401
    except ImportError:
        print("SKIP LoRA: peft is not installed here")
        return
    import tempfile

    from polar_lab.engine.weights import read_weights

    config = GRPOConfig(learning_rate=1e-2, dtype=args.dtype, device=args.device, micro_batch_size=4,
                        peft_config={"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]})
    policy = Policy(args.model, config, device=args.device)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    policy.update(samples)
    policy.update(samples)  # B starts at 0: the second step moves A too
    moved = {n for n, p in policy.model.named_parameters() if not torch.equal(before[n], p)}
    shipped = Policy(args.model, GRPOConfig(dtype="float32", device="cpu"), device="cpu")
    with tempfile.TemporaryDirectory() as folder:
        policy.write_weights(f"{folder}/merged.safetensors")
        shipped.load_state_dict(dict(read_weights(f"{folder}/merged.safetensors")))
    mean, worst = mean_abs_gap(policy.logprobs(samples), shipped.logprobs(samples), samples)
    only_adapter = bool(moved) and all(".lora_" in n for n in moved)
    report("LoRA", only_adapter and mean <= TOLERANCE[args.dtype],
           f"{len(moved)} tensors moved, {'all' if only_adapter else 'NOT all'} adapter; merged weights as shipped: "
           f"mean |Δ| {mean:.2e}, max {worst:.2e}")


def check_transfer(args, report) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("SKIP weight transfer: vLLM is not installed here")
        return
    if args.device != "cuda":
        print("SKIP weight transfer: NCCL and CUDA IPC need CUDA (the suite runs the gloo stand-in on CPU)")
        return
    from polar_lab import Lab
    from polar_lab.grpo.policy import outgoing_weights
    from polar_lab.types import SamplingSpec

    backend = "nccl" if torch.cuda.device_count() > 1 else "ipc"
    trainer_device = "cuda:1" if backend == "nccl" else "cuda:0"
    config = GRPOConfig(dtype=args.dtype, device=trainer_device)
    policy = Policy(args.model, config, device=trainer_device)
    with torch.no_grad():  # weights the engine cannot have from disk
        for p in policy.model.parameters():
            p.mul_(1.01)
    with Lab(args.model, port=0, weights_transport=backend, gpu_memory_utilization=0.3) as lab:
        prompt = lab.tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
        spec = SamplingSpec(max_tokens=32, temperature=1.0, seed=1, ignore_eos=True)
        seconds, outputs = {}, {}
        for how in ("transfer", "transfer", "slot"):
            t0 = time.perf_counter()
            if how == "transfer":
                lab.sync_weights(outgoing_weights(lab, policy, config))
            else:
                path = lab.weights_path()
                policy.write_weights(str(path), lab.engine.weights_dtype)
                lab.sync_weights(path)
            seconds[how] = time.perf_counter() - t0  # the second transfer: the group is open
            gen = lab.engine.submit(prompt, spec).result(timeout=300)
            outputs[how] = (gen.output_ids, gen.output_logprobs)
    report(f"weight transfer ({backend})", outputs["transfer"] == outputs["slot"],
           f"sync {seconds['transfer'] * 1e3:.0f} ms by {backend}, {seconds['slot'] * 1e3:.0f} ms by the slot; "
           f"same tokens and logprobs: {outputs['transfer'] == outputs['slot']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="data/models/tiny-calc")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("FAIL no CUDA device visible to torch")
        return 1
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, device {args.device} ({where}), dtype {args.dtype}, "
          f"{torch.cuda.device_count() if args.device == 'cuda' else 0} GPUs")
    failures = 0

    def report(name: str, ok: bool, figure: str) -> None:
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: {figure}")

    samples = make_samples(args.model, args.device, args.new_tokens, args.seed)
    reference, ref_name = reference_logprobs(args.model, samples)
    for s, lp in zip(samples, reference):
        s.behavior_logprobs = lp.clone()  # the "engine" logprobs the importance weights use
    config = GRPOConfig(learning_rate=1e-3, dtype=args.dtype, device=args.device, micro_batch_size=4)
    policy = Policy(args.model, config, device=args.device)
    mean, worst = mean_abs_gap(policy.logprobs(samples), reference, samples)
    report(f"trainer logprobs vs {ref_name}", mean <= TOLERANCE[args.dtype], f"mean |Δ| {mean:.2e}, max {worst:.2e}")

    start = policy.state_dict()
    t0 = time.perf_counter()
    stats = policy.update(samples)
    if args.device == "cuda":
        torch.cuda.synchronize()
    step_s = time.perf_counter() - t0
    after = policy.state_dict()
    moved = sum(bool((after[k] != start[k]).any()) for k in start)
    finite = torch.isfinite(torch.tensor([stats.loss, stats.grad_norm])).all()
    report("one GRPO update", bool(finite) and moved == len(start),
           f"loss {stats.loss:.4f}, grad norm {stats.grad_norm:.4f}, {moved}/{len(start)} tensors moved, "
           f"{step_s * 1e3:.0f} ms, {int(stats.tokens)} tokens")

    shipped = Policy(args.model, GRPOConfig(dtype="float32", device="cpu"), device="cpu")
    shipped.load_state_dict(after)  # what load_weights hands the engine
    mean, worst = mean_abs_gap(policy.logprobs(samples), shipped.logprobs(samples), samples)
    report("updated weights as shipped to the engine", mean <= TOLERANCE[args.dtype],
           f"mean |Δ| {mean:.2e}, max {worst:.2e} (trainer {args.dtype} on {args.device} vs fp32 CPU)")

    grads = policy.gradients()
    if args.world_size > 1:
        check_ranks(args, samples, start, after, stats, report)
        check_fsdp(args, samples, grads, stats, report)
    check_checkpointing(args, samples, grads, stats, report)
    check_lora(args, samples, report)
    check_transfer(args, report)
    print("ALL PASSED" if failures == 0 else f"{failures} FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
