"""How much memory a run needs per GPU (or per CPU rank), from the model's config alone — before buying time
on a node. `scripts/memory_plan.py` prints it; `benchmarks/trainer_memory.py` puts it next to measured peaks.

Engine (vLLM, per GPU of its tensor-parallel group):
    weights   params × bytes(engine dtype) / tp
    KV cache  2 (K and V) × attention layers × kv_heads/tp (at least 1) × head_dim × bytes × context × sequences
    states    a hybrid model's linear-attention layers (Qwen3.5's Gated DeltaNet) hold a fixed state per sequence
              instead: value heads × key dim × value dim (fp32) + the conv window, (kernel − 1) × conv channels
Trainer (per rank; fp32 master weights, AdamW):
    ddp       params × (4 weights + 4 grads + 8 Adam)
    fsdp      the same / ranks, plus the largest unit gathered whole (a layer, or for small models the root:
              embeddings and lm_head), with its gradients
    lora      base weights 4 bytes each (sharded with fsdp) + adapter × 16 (measured: its backward peak is
              higher than this plan says, docs/benchmarks.md)
    + activations of one micro-batch of `tokens` padded tokens: per layer and token, the tensors autograd
      keeps (`act_per_layer_token`, an estimate for a Llama/Qwen block with SDPA attention, and for a DeltaNet
      block with transformers' chunked PyTorch kernel); with
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
    # a hybrid's linear-attention (Gated DeltaNet) layers, counted in `layers`; 0 for an all-attention model
    linear_layers: int = 0
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 0
    output_gate: bool = False  # the attention's q_proj also makes a per-channel output gate (Qwen3.5)

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
        linear = list(getattr(text, "layer_types", None) or ()).count("linear_attention")
        hybrid = {}
        if linear:
            hybrid = dict(linear_layers=linear, linear_k_heads=text.linear_num_key_heads,
                          linear_v_heads=text.linear_num_value_heads, linear_k_dim=text.linear_key_head_dim,
                          linear_v_dim=text.linear_value_head_dim, conv_kernel=text.linear_conv_kernel_dim)
        return cls(params=params, layer_params=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
                   layers=len(layers), hidden=text.hidden_size, intermediate=text.intermediate_size, heads=heads,
                   kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                   head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads, vocab=text.vocab_size,
                   output_gate=bool(getattr(text, "attn_output_gate", False)), **hybrid)

    @property
    def attention_layers(self) -> int:
        return self.layers - self.linear_layers

    @property
    def conv_channels(self) -> int:
        """A DeltaNet layer's q, k and v channels: what its in_proj_qkv makes and its conv1d filters."""
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    def linear_state_bytes(self, engine_dtype_bytes: int) -> int:
        """One sequence's state in one DeltaNet layer: the recurrent matrix (fp32) and the conv window."""
        recurrent = self.linear_v_heads * self.linear_k_dim * self.linear_v_dim * 4
        return recurrent + (self.conv_kernel - 1) * self.conv_channels * engine_dtype_bytes

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """Adapter parameters for `targets` among the usual projection names, r × (in + out) each: attention
        projections in the attention layers, DeltaNet projections in the linear-attention layers, the MLP's in all."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        v = self.linear_v_heads * self.linear_v_dim
        attention = {"q_proj": (h, q * (2 if self.output_gate else 1)), "k_proj": (h, kv), "v_proj": (h, kv),
                     "o_proj": (q, h)}
        linear = {"in_proj_qkv": (h, self.conv_channels), "in_proj_z": (h, v), "in_proj_a": (h, self.linear_v_heads),
                  "in_proj_b": (h, self.linear_v_heads), "out_proj": (v, h)}
        mlp = {"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

        def count(shapes: dict, layers: int) -> int:
            return layers * sum(rank * sum(shapes[t]) for t in targets if t in shapes)
        return count(attention, self.attention_layers) + count(linear, self.linear_layers) + count(mlp, self.layers)

    def act_per_layer_token(self, seq_len: int, attention_weights: bool) -> int:
        """Elements autograd keeps per layer and token: attention block (norm, q/k/v, rotated q/k, output,
        o_proj input, residual), with `attention_weights` its probabilities too (heads × sequence length: SDPA
        with a padding mask on CPU takes the math path; GPU flash kernels keep a logsumexp per head), MLP
        block (norm, gate, up, activation, product, residual). On SmolLM2-135M (256-token sequences, CPU)
        this is 13.1k elements against 14.3k counted with saved-tensor hooks. A hybrid's layers are averaged: an
        attention layer as above (an output gate adds its gate and gated output), a DeltaNet layer
        (`linear_act_per_token`)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = 3 * self.hidden + 2 * q + 3 * kv + self.heads * (seq_len if attention_weights else 1)
        attention += 2 * q if self.output_gate else 0
        mlp = 2 * self.hidden + 4 * self.intermediate
        if not self.linear_layers:
            return attention + mlp
        mixed = self.attention_layers * attention + self.linear_layers * self.linear_act_per_token()
        return mixed // self.layers + mlp

    def linear_act_per_token(self, chunk: int = 64) -> int:
        """Elements a DeltaNet block keeps per token: norm, in_proj_qkv's output and the conv's (the q, k, v
        channels twice), k and q normalised and spread to the value heads, z, a and b, the decay and beta, the
        chunked kernel's per-chunk matrices (value heads × chunk), its output, the gated norm's output, and the
        residual. An estimate from transformers' PyTorch kernel; fused kernels (flash-linear-attention) keep less."""
        v = self.linear_v_heads * self.linear_v_dim
        spread = 2 * self.linear_v_heads * self.linear_k_dim
        return (3 * self.hidden + 2 * self.conv_channels + spread + 4 * v + 4 * self.linear_v_heads
                + 2 * self.linear_v_heads * chunk)


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
              "kv_cache": 2 * shape.attention_layers * kv_per_gpu * shape.head_dim * engine_dtype_bytes * context
              * sequences}
    if shape.linear_layers:  # heads split over tp like the attention's
        engine["linear_states"] = shape.linear_layers * shape.linear_state_bytes(engine_dtype_bytes) * sequences / tp
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
