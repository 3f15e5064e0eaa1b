"""Peak memory of the loss's logprobs, full logits vs chunked: forward + backward of one sequence's token logprobs
through a model with a Qwen-sized vocabulary (151,936), on CPU.

The reference path (`TokenLogprobs(model, chunk=None)`, i.e. `token_logprobs`) materialises the (T-1, V) logits, then an fp32 copy,
and keeps them for backward; `TokenLogprobs` runs the lm_head `chunk` positions at a time in fp32 and
recomputes each chunk in backward. The model is random (from a config: no weights to download), 2 layers of
width 128, so the logits dominate. Each variant runs in its own process; printed: the peak resident memory
above the process's memory once the model and input exist (ru_maxrss), and the seconds of forward + backward.

    python benchmarks/logprob_memory.py [--tokens 2048] [--chunk 512]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from result import save


def measure(variant: str, tokens: int, chunk: int) -> dict[str, float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from polar_lab.grpo.loss import TokenLogprobs

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=151_936, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=tokens + 1)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (1, tokens))
    mask, temps = torch.ones_like(ids), torch.ones(1)
    target = TokenLogprobs(model, chunk if variant == "chunked" else None)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    target(ids, mask, temps).sum().backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"variant": variant, "extra_mib": (peak - before) / 1024, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--variant", choices=["full", "chunked"])
    args = parser.parse_args()
    if args.variant:  # one measurement, in this (fresh) process
        print(json.dumps(measure(args.variant, args.tokens, args.chunk)))
        return
    logits_mib = (args.tokens - 1) * 151_936 * 4 / 2**20
    print(f"{args.tokens} tokens, vocabulary 151,936: one fp32 copy of the logits is {logits_mib:.0f} MiB; "
          f"chunk {args.chunk}: {args.chunk * 151_936 * 4 / 2**20:.0f} MiB")
    rows = {}
    for variant in ("full", "chunked"):
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--tokens", str(args.tokens),
                              "--chunk", str(args.chunk)], capture_output=True, text=True, check=True)
        got = rows[variant] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{variant:8s} peak above the model: {got['extra_mib']:7.0f} MiB   forward+backward {got['seconds']:.2f} s")
    save("logprob_memory", {"peak above the model, full logits (MiB)": round(rows["full"]["extra_mib"]),
                            f"peak above the model, chunks of {args.chunk} (MiB)": round(rows["chunked"]["extra_mib"]),
                            "forward + backward, full / chunked (s)": f"{rows['full']['seconds']:.2f} / "
                                                                      f"{rows['chunked']['seconds']:.2f}",
                            "one fp32 copy of the logits (MiB)": round(logits_mib)},
         notes=[f"{args.tokens} tokens, a random 2-layer model of width 128: the head is nearly all of it"],
         title="The loss's logits in chunks",
         raw={"tokens": args.tokens, "chunk": args.chunk, **rows})


if __name__ == "__main__":
    main()
