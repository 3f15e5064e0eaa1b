"""How much memory a run needs per GPU (or per CPU rank), from the model's config alone — before buying time
on a node. `scripts/memory_plan.py` prints it; `benchmarks/trainer_memory.py` puts it next to measured peaks.

Engine (vLLM, per GPU of its tensor-parallel group):
    weights   params × bytes(engine dtype) / tp
    KV cache  2 (K and V) × layers × kv_heads/tp (at least 1) × head_dim × bytes × context × sequences
Trainer (per rank; fp32 master weights, AdamW):
    ddp       params × (4 weights + 4 grads + 8 Adam)
    fsdp      the same / ranks, plus the largest unit gathered whole (a layer, or for small models the root:
              embeddings and lm_head), with its gradients
    lora      base weights 4 bytes each (sharded with fsdp) + adapter × 16 (measured: its backward peak is
              higher than this plan says, docs/benchmarks.md)
    + activations of one micro-batch of `tokens` padded tokens: per layer and token, the tensors autograd
      keeps (`act_per_layer_token`, an estimate for a Llama/Qwen block with SDPA attention); with
      checkpointing only each layer's input is kept, plus one layer's whole activations while it is
      recomputed
    + the loss's logits: `logprob_chunk_tokens` × vocab fp32, ~4.5 copies (measured)
The estimate leaves out allocator slack, the CUDA context (~0.5 GiB) and, on CPU, the interpreter and
libraries (~0.5–1 GiB per process: `runtime` in the benchmark).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GIB = 1024 ** 3
# fp32 copies of one chunk's logits alive at the loss's peak (logits, softmax, their gradients, recomputed in
# backward): benchmarks/logprob_memory.py measured 1,329 MiB above the model for 297 MiB chunks
LOGIT_COPIES = 4.5


@dataclass
class ModelShape:
    params: int  # all parameters (tied embeddings counted once)
    layer_params: int  # the largest decoder layer's
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """Exact parameter counts from an empty (meta-device) model built from the config."""
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in model.parameters())  # a tied weight is one parameter
        layers = model.get_decoder().layers
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        return cls(params=params, layer_params=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
                   layers=len(layers), hidden=text.hidden_size, intermediate=text.intermediate_size, heads=heads,
                   kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads, vocab=text.vocab_size)

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """Adapter parameters for `targets` among the usual projection names, r × (in + out) each."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                  "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        return self.layers * sum(rank * sum(shapes[t]) for t in targets if t in shapes)

    def act_per_layer_token(self, seq_len: int, attention_weights: bool) -> int:
        """Elements autograd keeps per layer and token: attention block (norm, q/k/v, rotated q/k, output,
        o_proj input, residual), with `attention_weights` its probabilities too (heads × sequence length: SDPA
        with a padding mask on CPU takes the math path; GPU flash kernels keep a logsumexp per head), MLP
        block (norm, gate, up, activation, product, residual). On SmolLM2-135M (256-token sequences, CPU)
        this is 13.1k elements against 14.3k counted with saved-tensor hooks."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = 3 * self.hidden + 2 * q + 3 * kv + self.heads * (seq_len if attention_weights else 1)
        mlp = 2 * self.hidden + 4 * self.intermediate
        return attention + mlp


def plan(shape: ModelShape, *, strategy: str = "ddp", ranks: int = 1, tokens: int = 2048, seq_len: int | None = None,
         micro_batches: int = 1, checkpointing: bool = False, chunk: int = 4096, lora_rank: int = 0,
         lora_targets: list[str] | None = None, engine_dtype_bytes: int = 2, tp: int = 1, context: int = 32768,
         sequences: int = 1, attention: str = "flash", reference: bool = False) -> dict[str, Any]:
    """Bytes per GPU/rank, by part, for the engine and for one trainer rank. `tokens`: padded tokens of one
    micro-batch (its sequences are `seq_len` long, default all of them one); `micro_batches` per update and
    rank (from the second on, the gradients accumulated so far are held while a micro-batch's activations
    are). `attention`: "flash" (GPU kernels) or "math" (CPU: the probabilities are kept). `reference`: a KL
    term's frozen copy of the model (GRPOConfig.beta > 0), sharded like the policy. The trainer's peak is the larger of the forward/backward phase and the optimiser step; the parts
    are listed, their sum is not the peak."""
    kv_per_gpu = max(1, shape.kv_heads // tp)
    engine = {"weights": shape.params * engine_dtype_bytes / tp,
              "kv_cache": 2 * shape.layers * kv_per_gpu * shape.head_dim * engine_dtype_bytes * context * sequences}
    adapter = shape.lora_params(lora_rank, lora_targets or []) if lora_rank else 0
    share = ranks if strategy == "fsdp" else 1
    if adapter:  # sharded like every parameter under fsdp
        trainer = {"parameters": 4 * (shape.params + adapter) / share, "gradients": 4 * adapter / share,
                   "optimizer": 8 * adapter / share}
    else:
        trainer = {"parameters": 4 * shape.params / share, "gradients": 4 * shape.params / share,
                   "optimizer": 8 * shape.params / share}
    if reference:
        trainer["reference"] = 4 * shape.params / share
    if strategy == "fsdp" and ranks > 1:  # the largest unit gathered whole: a layer, or the root (embeddings,
        root = shape.params - shape.layers * shape.layer_params  # final norm, lm_head), with its gradients
        trainer["gathered_unit"] = 4 * max(shape.layer_params, root) * (1 if adapter else 2)
    per_layer = shape.act_per_layer_token(seq_len or tokens, attention == "math") * 4 * tokens
    if checkpointing:
        trainer["activations"] = shape.layers * shape.hidden * 4 * tokens + per_layer
    else:
        trainer["activations"] = shape.layers * per_layer
    trainer["logits"] = LOGIT_COPIES * min(chunk, tokens) * shape.vocab * 4
    head = 0.0 if adapter else 4 * shape.vocab * shape.hidden  # the lm_head's gradient, made while every
    held_grads = trainer["gradients"] if micro_batches > 1 else 0.0  # activation is still alive
    backward = held_grads + head + trainer["activations"] + trainer["logits"] + trainer.get("gathered_unit", 0.0)
    step = trainer["gradients"] + trainer["optimizer"]
    return {"engine": engine, "engine_total": sum(engine.values()), "trainer": trainer,
            "trainer_total": trainer["parameters"] + trainer.get("reference", 0.0) + max(backward, step),
            "trainer_step_peak": max(backward, step)}


def format_plan(result: dict[str, Any], title: str) -> str:
    lines = [title]
    for side in ("engine", "trainer"):
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in result[side].items())
        lines.append(f"  {side:8s} {result[side + '_total'] / GIB:7.2f} GiB  ({parts})")
    return "\n".join(lines)
