"""The trainer's policy: a transformers model and its optimiser, one rank. No threads, no processes.

`Policy.update(samples)` is one GRPO update (num_iterations optimiser steps) on the samples it is given;
the per-token weights inside the samples already carry the normalisation of the *whole* batch, so ranks
that each see a shard compute exactly the shards of one loss (see distributed.py). When the model is
wrapped in DDP, gradients are averaged over ranks; the loss is multiplied by the world size to make that
average a sum.
"""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from polar_lab.engine.weights import WeightsWriter, write_weights as write_weights_file
from polar_lab.errors import TrainerError
from polar_lab.grpo import lora
from polar_lab.grpo.batch import Sample, collate, micro_batch_groups, micro_batches, same_count_on_every_rank
from polar_lab.grpo.config import GRPOConfig
from polar_lab.grpo.loss import TokenLogprobs, policy_loss
from polar_lab.grpo.prefix import SharedPrefix, supported_by
from polar_lab.grpo.scorers import FrozenScorers, disable_dropout
from polar_lab.grpo.xray import token_rows

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class Policy:
    on_ray = False  # one rank in this process (DistributedPolicy.on_ray: ranks as Ray actors)

    def __init__(self, model_path: str, config: GRPOConfig, *, device: str = "cpu", world_size: int = 1):
        """One rank. `world_size` > 1, or strategy "fsdp", means a process group exists (distributed.py's
        worker made it) and the model is wrapped in DDP or sharded with FSDP2 before the optimiser is built."""
        from transformers import AutoModelForCausalLM, get_scheduler

        self.config = config  # the kernel's torch RNG is left alone (LoRA's init draws from a forked, seeded one)
        self.device = torch.device(device)
        # weights and optimizer state stay fp32 (bf16 weights would round Adam's ~lr-sized steps away);
        # dtype=bfloat16 runs the forward/backward under autocast
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        self._autocast_dtype = _DTYPES[config.dtype]
        self.model.train()
        if config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.world_size = world_size
        self.sharded = config.strategy == "fsdp"
        self.scorers = FrozenScorers(self.model, model_path, config, self.device,  # the reference, the teacher
                                     shard=(lambda m: shard_model(m, config, self.device)) if self.sharded else None)
        self.lora = config.peft_config is not None
        if self.lora:  # base weights frozen, adapter matrices trained (lora.py)
            from peft import get_peft_model

            cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
            with torch.random.fork_rng(devices=cuda):  # A's random init: the same on every rank and every run,
                torch.manual_seed(config.seed)  # and the kernel's RNGs (CPU and every GPU) left as they were
                self.model = get_peft_model(self.model, config.peft_config)
        disable_dropout(self.model)  # the sampler had none (LoRA's dropout too): with it, π_old ≠ μ before any step
        self.train_model = TokenLogprobs(self.model, config.logprob_chunk_tokens)  # the step's whole forward
        if self.sharded:
            shard_model(self.train_model, config, self.device)  # parameters become DTensor shards, in place
        elif world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.train_model = DistributedDataParallel(
                self.train_model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.optimizer = torch.optim.AdamW(_param_groups(self.model, config.weight_decay), lr=config.learning_rate,
                                           betas=(config.adam_beta1, config.adam_beta2))
        total = config.max_steps * config.num_iterations
        warmup = "_with_warmup" if config.lr_scheduler_type == "constant" and config.warmup_ratio else ""
        self.scheduler = get_scheduler(config.lr_scheduler_type + warmup, self.optimizer,
                                       num_warmup_steps=round(config.warmup_ratio * total), num_training_steps=total)
        self.pad_id = self.model.config.pad_token_id or 0
        self.steps = 0
        # whether an update may run its samples' shared prompt once (grpo/prefix.py): one process, a cache it can fill
        self._shares_prefix = world_size == 1 and not self.sharded and not config.gradient_checkpointing \
            and self._logprobs_model.chunked and supported_by(self.model)

    def update(self, samples: list[Sample]) -> UpdateStats:
        """One GRPO update on `samples`; returns summed statistics (merge ranks with `+`)."""
        groups = micro_batch_groups(samples, self.config)
        micro = same_count_on_every_rank([collate(g, self.pad_id, self.device) for g in groups], self.device)
        frozen = [self._frozen_logprobs(mb) for mb in micro]  # (old, ref, teacher) per micro-batch
        totals = UpdateStats()
        self._logprobs_model.outside_support = 0
        for iteration in range(self.config.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            shared = self._shared_prefix(samples)  # None, or the samples' common prompt, run once with gradients
            for i, (mb, (old, ref, teacher)) in enumerate(zip(micro, frozen)):
                last = i == len(micro) - 1
                with self._no_sync(not last), self._autocast():
                    logp = shared.logprobs(mb) if shared else self.train_model(
                        mb["input_ids"], mb["attention_mask"], mb["temperature"], mb.get("support"))
                    loss, stats = policy_loss(logp, old if old is not None else logp.detach(), mb["behavior"],
                                              ref, mb["advantage"], mb["weights"], self.config, teacher,
                                              xray=self.config.xray_steps > 0 and iteration == 0 and i < len(groups))
                    (loss * self.world_size).backward()
                if "xray" in stats:
                    totals.xray += token_rows(groups[i], stats.pop("xray"))
                if iteration == 0:
                    totals.add(stats)  # tokens, loss, IS: what the batch was; later passes re-use it
                    totals.outside_support = float(self._logprobs_model.outside_support)
                else:
                    totals.clipped += float(stats["clipped"])  # ratios move away from 1 only after a step
            if shared:
                with self._autocast():
                    shared.backward()
                totals.shared_prefix_tokens = shared.length
            totals.grad_norm = self._clip_and_step()
            totals.skipped += not math.isfinite(totals.grad_norm)
        totals.iterations = self.config.num_iterations
        self.steps += 1
        return totals

    @torch.no_grad()
    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """The trainer's logprob of every target of each sample (L-1 each), at the sample's temperature."""
        out = []
        for s in samples:
            mb = collate([s], self.pad_id, self.device)
            with self._autocast():
                out.append(self._logprobs_model(mb["input_ids"], mb["attention_mask"], mb["temperature"],
                                                mb.get("support"))[0].cpu())
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """CPU fp32 tensors named as in the HF checkpoint, `lm_head.weight` included (vLLM needs it); with LoRA
        the merged weights. Sharded: every rank must call it (each tensor is gathered from all); rank 0 gets
        them, the others `{}`."""
        out = {}
        for name, tensor in self._full_tensors():
            if self._rank == 0:
                out[name] = tensor.to("cpu").clone()
        return out

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last update's gradients (after clipping), full CPU tensors named like the parameters: which
        layers learn, and how much. Sharded: every rank must call it; rank 0 gets them, the others `{}`."""
        out = {}
        for name, param in self.model.named_parameters():
            if param.grad is not None:
                grad = _full(param.grad.detach())
                if self._rank == 0:
                    out[name] = grad.to("cpu").clone()
        return out

    def write_adapter(self, folder: str) -> int:
        """LoRA: the adapter alone as a PEFT folder the engine serves (lora.py); every rank must call it (the
        adapter's tensors are gathered when sharded); returns the bytes written (0 on other ranks)."""
        if not self.lora:
            raise TrainerError("write_adapter needs a LoRA policy (GRPOConfig.peft_config)")
        tensors = lora.adapter_tensors(self.model, _full)  # every rank takes part in the gathers, first
        if self._rank != 0:
            return 0
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.model.peft_config["default"].save_pretrained(folder)
        size = write_weights_file(Path(folder) / lora.ADAPTER_WEIGHTS, tensors)
        return size + (Path(folder) / lora.ADAPTER_CONFIG).stat().st_size

    def write_weights(self, path: str, dtype: torch.dtype | None = None) -> int:
        """Write the weights as a safetensors file the engine maps (engine/weights.py), one tensor at a time:
        sharded, each is gathered, written by rank 0, freed — no rank ever holds a full copy of the model.
        With LoRA, the merged weights (W + scale·B·A). Floating tensors are stored as `dtype` (the engine's; None:
        as trained). A file that has the layout already (the Lab's slot, `lab.weights_path()`) is written in place.
        Every rank must call it; returns the file's size (0 on other ranks)."""
        return _write_gathered(path, self._layout(), self._full_tensors(), self._rank == 0, dtype)

    def _layout(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(HF name, dtype, global shape) of what `_full_tensors` yields."""
        return lora.merged_layout(self.model) if self.lora else \
            [(name, t.dtype, tuple(t.shape)) for name, t in self.model.state_dict().items()]

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    def save_training_state(self, folder: str) -> None:
        """Model and optimiser state with torch.distributed.checkpoint: sharded, each rank writes its own
        shards (FSDP); else one rank's full state. Every rank must call it. `load_training_state` reads it
        back, also with another number of ranks."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        with _single_process_checkpoint():
            dcp.save({"model": model_state, "optimizer": optim_state, "steps": self.steps,
                      "scheduler": self.scheduler.state_dict()}, checkpoint_id=folder, no_dist=not _distributed())

    def load_training_state(self, folder: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state, "steps": self.steps,
                 "scheduler": self.scheduler.state_dict()}
        with _single_process_checkpoint():
            dcp.load(state, checkpoint_id=folder, no_dist=not _distributed())
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = state["steps"]

    def memory(self, *, reset_peak: bool = False) -> dict[str, int]:
        """This process's resident memory now and at its peak, and on GPU torch's peak, in bytes (`process_memory`)."""
        return process_memory(self.device, reset_peak=reset_peak)

    def close(self) -> None:
        pass  # nothing outside this process

    # ---- internals -------------------------------------------------------------------------------
    @property
    def _logprobs_model(self) -> TokenLogprobs:
        """The chunked logprob model without DDP (no gradients, no all-reduce); FSDP's is the model itself."""
        return getattr(self.train_model, "module", self.train_model)

    @property
    def _rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if _distributed() else 0

    def _full_tensors(self):
        """(HF name, full tensor) of each weight, in order (LoRA: merged); a DTensor shard is gathered from
        every rank first (a collective: all ranks iterate together)."""
        if self.lora:
            yield from lora.merged_tensors(self.model, _full)
            return
        for name, tensor in self.model.state_dict().items():
            yield name, _full(tensor.detach())

    def _micro_batches(self, samples: list[Sample]) -> list[dict[str, torch.Tensor]]:
        return micro_batches(samples, self.config, self.pad_id, self.device)

    @torch.no_grad()
    def _frozen_logprobs(self, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        """π_old (only needed when the batch is reused), π_ref (with a KL term) and π_teacher (distilling), before
        any step."""
        with self._autocast():
            old = None
            if self.config.num_iterations > 1:
                old = self._logprobs_model(mb["input_ids"], mb["attention_mask"], mb["temperature"],
                                           mb.get("support"))
            return (old, *self.scorers.score(mb))

    def _shared_prefix(self, samples: list[Sample]) -> SharedPrefix | None:
        """The update's shared prompt, run forward now (grpo/prefix.py), or None."""
        with self._autocast():
            return SharedPrefix.of(self._logprobs_model, samples, self.config.shared_prefix_min_tokens,
                                   self.device) if self._shares_prefix else None

    def _autocast(self):
        enabled = self._autocast_dtype != torch.float32
        return torch.autocast(self.device.type, dtype=self._autocast_dtype, enabled=enabled)

    def _no_sync(self, skip: bool):
        if skip and hasattr(self.train_model, "no_sync"):
            return self.train_model.no_sync()  # DDP: all-reduce only on the last micro-batch
        return contextlib.nullcontext()

    def _clip_and_step(self) -> float:
        """Clip and step; a non-finite gradient norm skips the step (the weights stay as they were) and is
        returned as NaN. Every rank sees the same norm after the all-reduce, so every rank skips together."""
        from torch.distributed.tensor import DTensor

        params = [p for p in self.model.parameters() if p.grad is not None]
        limit = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf  # inf: only measure
        norm = torch.nn.utils.clip_grad_norm_(params, limit) if params else torch.tensor(0.0)
        if isinstance(norm, DTensor):  # FSDP: the norm over every rank's shards
            norm = norm.full_tensor()
        if not math.isfinite(float(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return float("nan")
        self.optimizer.step()
        self.scheduler.step()
        return float(norm)


@dataclass
class UpdateStats:
    """Statistics of one update, summed over micro-batches (first iteration) and ranks; merge with `+`."""

    tokens: float = 0.0  # trained tokens
    loss: float = 0.0
    pg_loss: float = 0.0
    kl_weighted: float = 0.0
    kl_sum: float = 0.0  # k3 KL summed over trained tokens
    clipped: float = 0.0  # (token, iteration) pairs whose ratio was clipped, over all num_iterations passes
    is_capped: float = 0.0  # trained tokens whose correction weight was truncated (a *_truncate mode's bounds)
    is_masked: float = 0.0  # trained tokens a *_mask mode zeroed
    outside_support: float = 0.0  # sampled tokens the trainer's replayed support masks cut, kept in (see support.py)
    mismatch_kl_sum: float = 0.0  # k3 estimate of KL(μ ‖ π_old) summed over trained tokens (engine vs trainer)
    distill_kl_sum: float = 0.0  # log π_old − log π_teacher summed over trained tokens (0 without a teacher)
    log_is: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # (tokens,) log(π_old / μ) per token
    grad_norm: float = float("nan")  # before clipping; the same on every rank after the all-reduce
    iterations: int = 1  # passes over the batch (GRPOConfig.num_iterations)
    skipped: int = 0  # of those passes, the ones whose optimiser step was skipped (non-finite gradient norm)
    shared_prefix_tokens: int = 0  # leading tokens the update ran once for every sample (grpo/prefix.py); 0: none
    xray: list[dict] = field(default_factory=list)  # per sample, the loss's per-token tensors (grpo/xray.py)

    @property
    def stepped(self) -> bool:
        """Whether any optimiser step changed the weights (else there is nothing to sync)."""
        return self.skipped < self.iterations

    def add(self, stats: dict[str, torch.Tensor]) -> None:
        """Add one micro-batch's `policy_loss` statistics."""
        for name, value in stats.items():
            value = value.detach().float().cpu()
            setattr(self, name, torch.cat([self.log_is, value]) if name == "log_is" else getattr(self, name) + float(value))

    def __add__(self, other: UpdateStats) -> UpdateStats:
        sums = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)
                if f.name not in ("log_is", "grad_norm", "iterations", "skipped", "xray")}
        return UpdateStats(**sums, log_is=torch.cat([self.log_is, other.log_is]), grad_norm=self.grad_norm,
                           iterations=self.iterations, skipped=self.skipped,  # the same on every rank
                           xray=self.xray + other.xray)

    def metrics(self) -> dict[str, float]:
        """The logged metrics: means over trained tokens, importance-ratio quantiles."""
        tokens = max(self.tokens, 1.0)
        ratio = self.log_is.exp()
        empty = not len(ratio)
        q = torch.full((3,), float("nan")) if empty else torch.quantile(ratio, torch.tensor([0.05, 0.5, 0.95]))
        return {
            "loss": self.loss, "pg_loss": self.pg_loss, "kl": self.kl_sum / tokens,
            "clip_frac": self.clipped / (tokens * self.iterations),
            "grad_norm": self.grad_norm, "is_ratio_mean": float("nan") if empty else float(ratio.mean()),
            "is_ratio_p05": float(q[0]), "is_ratio_p50": float(q[1]), "is_ratio_p95": float(q[2]),
            "is_ratio_max": float("nan") if empty else float(ratio.max()), "is_capped_frac": self.is_capped / tokens,
            "is_masked_frac": self.is_masked / tokens, "mismatch_kl": self.mismatch_kl_sum / tokens,
            "distill_kl": self.distill_kl_sum / tokens,
            "logprob_abs_diff_mean": float("nan") if empty else float(self.log_is.abs().mean()),
            "skipped_steps": self.skipped, "outside_support_tokens": self.outside_support,
            "shared_prefix_tokens": self.shared_prefix_tokens,
        }


def process_memory(device: torch.device, *, reset_peak: bool = False) -> dict[str, int]:
    """This process's resident memory now and at its peak (Linux VmRSS / VmHWM), and on GPU the peak allocated by
    torch, in bytes; `reset_peak` starts a new peak (for the memory benchmark)."""
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    out = {"rss": int(status["VmRSS"].split()[0]) * 1024, "peak": int(status["VmHWM"].split()[0]) * 1024}
    if device.type == "cuda":
        out["cuda_peak"] = torch.cuda.max_memory_allocated(device)
    if reset_peak:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current resident size
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
    return out


def outgoing_weights(lab, policy, config: GRPOConfig, *, full: bool = False):
    """What a trainer's sync sends (`lab.sync_weights(...)`): a LoRA adapter's folder (lora_sync="adapter", unless
    `full`), the policy's weights written into the Lab's slot in the engine's dtype, or — where the engine takes
    weights through vLLM's transfer API (weights_transport nccl, ipc, gloo) — the policy's transfer into it."""
    from polar_lab.engine.weight_transfer import TRANSFER_BACKENDS

    adapter = config.peft_config is not None and config.lora_sync == "adapter" and not full
    transport = lab.config.engine.weights_transport
    if not adapter and transport in TRANSFER_BACKENDS:
        return _transfer(policy, lab.engine, transport, config)
    path = lab.weights_path(adapter=adapter)
    if adapter:
        policy.write_adapter(str(path))  # the adapter alone: the engine keeps the base weights
    else:  # into the slot the engine is not serving, in its dtype: in place, through a mapping (engine/weights.py)
        policy.write_weights(str(path), lab.engine.weights_dtype)
    return path


_TRANSFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # policy → its open WeightTransfer


def _transfer(policy, engine, backend: str, config: GRPOConfig):
    """The policy's weights as a transfer through vLLM's weight-transfer API into `engine` (engine/weight_transfer.py):
    made once per engine and kept (its group stays open), floating matrices in the engine's dtype."""
    from polar_lab.engine.weight_transfer import PolicySource, WeightTransfer

    if not isinstance(policy, Policy):
        raise TrainerError(f"weights_transport={backend!r} sends from a trainer in the Lab's process (world_size=1, "
                           f"strategy ddp); with {config.world_size} ranks ({config.strategy}) use 'memory'")
    kept = _TRANSFERS.get(policy)
    if kept is None or kept.engine is not engine or kept.backend != backend:
        source = PolicySource(policy._layout(), policy._full_tensors, engine.weights_dtype)
        _TRANSFERS[policy] = kept = WeightTransfer(backend, source, engine)
    return kept


def _write_gathered(path, layout, tensors, writes: bool, dtype: torch.dtype | None = None) -> int:
    """Write `tensors` (gathered as they are iterated) into a weights file on the rank that `writes`; the
    others only iterate, taking part in each gather. An error on the writing rank (no room in /dev/shm, a
    layout mismatch) is raised only after the iteration ends, so no other rank is left waiting in a gather;
    the partial file is removed. Returns the file's size (0 where nothing was written)."""
    writer, error = None, None
    if writes:
        try:
            writer = WeightsWriter(path, layout, dtype=dtype)
        except Exception as exc:  # noqa: BLE001 - raised below, after the gathers
            error = exc
    for name, tensor in tensors:
        if writer is not None and error is None:
            try:
                writer.write(name, tensor)
            except Exception as exc:  # noqa: BLE001 - raised below, after the gathers
                error = exc
    if writer is not None:
        if error is None:
            writer.close()
            return writer.bytes
        writer.__exit__(type(error), error, None)  # closes and removes the partial file
    if error is not None:
        raise error
    return 0


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A whole tensor: a DTensor shard gathered from every rank (a collective), anything else as it is.
    Shards offloaded to the CPU are gathered on the mesh's device (an NCCL group moves only GPU tensors)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    mesh_device = tensor.device_mesh.device_type
    if tensor.device.type != mesh_device:
        return tensor.to(mesh_device).full_tensor().to(tensor.device)
    return tensor.full_tensor()


@contextlib.contextmanager
def _single_process_checkpoint():
    """torch.distributed.checkpoint warns on every save/load without a process group (`no_dist=True`), which
    is how the in-process trainer uses it, on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _distributed() -> bool:
    """Whether this process is a rank of a process group (distributed.py's workers), not the kernel."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def shard_model(model: TokenLogprobs, config: GRPOConfig, device: torch.device, *, precision=None) -> None:
    """FSDP2 (`fully_shard`), in place: one unit per decoder layer (its parameters are gathered just before
    it runs and freed after), then the wrapper as the root unit (embeddings, final norm, lm_head). On GPU
    with dtype bfloat16, parameters are gathered in bf16 and gradients reduced in fp32 (`fsdp_precision`); on CPU
    they stay fp32 (autocast does the bf16 compute, as without FSDP). `cpu_offload` keeps the shards and the
    optimiser state in host memory. precision: (the layers' policy, the root's), default `fsdp_precision`'s."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    import torch.distributed as dist

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layers_policy, root_policy = precision or fsdp_precision(device.type, config.dtype)
    options: dict[str, Any] = {"mesh": mesh}
    if config.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model.model):
        fully_shard(layer, **options, **({"mp_policy": layers_policy} if layers_policy else {}))
    fully_shard(model, **options, **({"mp_policy": root_policy} if root_policy else {}))


def fsdp_precision(device_type: str, dtype: str) -> tuple[Any, Any]:
    """FSDP2's mixed-precision policies (the decoder layers', the root's); (None, None): none (fp32, or CPU).

    The root keeps its floating-point inputs as they are (`cast_forward_inputs=False`): FSDP2 casts them to the
    parameter dtype by default, and the root's inputs include each sample's temperature — 0.7 in bf16 is 0.69921875,
    so the trainer would score every token at another temperature than the engine sampled at. The layers' inputs
    are activations: those are cast, as the policy intends."""
    if device_type != "cuda" or dtype != "bfloat16":
        return None, None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    layers = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return layers, root


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's stack of layers (`model.get_decoder().layers` in every HF causal LM we chunk)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: no decoder `layers` list to shard")
    return layers


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on weight matrices only, never on biases, norms (1-D) or embeddings."""
    decay, keep = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:  # LoRA's frozen base weights: no Adam state for them
            continue
        (keep if param.ndim < 2 or "embed" in name else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]
