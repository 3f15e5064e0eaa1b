"""Memory per GPU for the engine and one trainer rank, from a model folder's config (no weights read).

    python scripts/memory_plan.py MODEL_DIR --gpus 8 --strategy fsdp [--engine-tp 2] [--tokens 16384]
        [--checkpointing] [--lora-rank 16] [--context 65536] [--sequences 32]

--gpus is the node's GPU count: the engine takes --engine-tp of them, the trainer ranks the rest (the default
layout, engine/layout.py). Prints ddp, fsdp and lora side by side when --strategy all. The formula and what it
leaves out: polar_lab/grpo/memory.py; checked against measured peaks in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse

from transformers import AutoConfig

from polar_lab.grpo.memory import GIB, ModelShape, format_plan, plan

# every projection: attention, MLP, and a hybrid's DeltaNet ones (names a model lacks count nothing)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv", "in_proj_z",
           "out_proj"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs on the node (engine + trainer)")
    parser.add_argument("--engine-tp", type=int, default=1, help="the engine's tensor-parallel size")
    parser.add_argument("--strategy", choices=["ddp", "fsdp", "lora", "all"], default="all")
    parser.add_argument("--tokens", type=int, default=16384, help="padded tokens per micro-batch")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: --tokens, one "
                                                                   "sequence per micro-batch)")
    parser.add_argument("--attention", choices=["flash", "math"], default="flash",
                        help="flash (GPU kernels) or math (CPU: attention probabilities kept for backward)")
    parser.add_argument("--beta", action="store_true", help="a KL term (GRPOConfig.beta > 0): a reference copy")
    parser.add_argument("--checkpointing", action="store_true", help="gradient_checkpointing=True")
    parser.add_argument("--chunk", type=int, default=4096, help="logprob_chunk_tokens")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--context", type=int, default=65536, help="context length the KV cache is sized for")
    parser.add_argument("--sequences", type=int, default=16, help="sequences at that length the engine holds at once")
    parser.add_argument("--engine-dtype-bytes", type=int, default=2, help="2 = bf16, 4 = fp32")
    args = parser.parse_args()

    shape = ModelShape.from_config(AutoConfig.from_pretrained(args.model))
    ranks = max(1, args.gpus - args.engine_tp)
    print(f"{args.model}: {shape.params / 1e9:.3f}B parameters, {shape.layers} layers, vocab {shape.vocab}; "
          f"{args.gpus} GPUs = engine tp {args.engine_tp} + {ranks} trainer rank(s); micro-batch {args.tokens} "
          f"tokens{', checkpointing' if args.checkpointing else ''}; KV cache for {args.sequences} × {args.context}")
    strategies = ["ddp", "fsdp", "lora"] if args.strategy == "all" else [args.strategy]
    for strategy in strategies:
        lora = strategy == "lora"
        result = plan(shape, strategy="fsdp" if lora else strategy, ranks=ranks, tokens=args.tokens, seq_len=args.seq_len,
                      checkpointing=args.checkpointing, chunk=args.chunk, lora_rank=args.lora_rank if lora else 0,
                      lora_targets=TARGETS, engine_dtype_bytes=args.engine_dtype_bytes, tp=args.engine_tp,
                      context=args.context, sequences=args.sequences, attention=args.attention,
                      reference=args.beta)
        title = f"{strategy}" + (f" (rank {args.lora_rank}, all projections, fsdp)" if lora else "")
        print(format_plan(result, title))
    print(f"(trainer = parameters + the update's peak, the larger of backward and the optimiser step; GiB = {GIB} "
          f"bytes; add ~0.5 GiB per process for the CUDA context and allocator slack)")


if __name__ == "__main__":
    main()
