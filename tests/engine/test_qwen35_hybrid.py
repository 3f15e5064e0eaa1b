"""The paper's architecture in the engine: vLLM's own `Qwen3_5ForCausalLM` — Gated DeltaNet linear-attention layers
and full-attention layers — serving through a Lab on CPU, with the torchvision stand-in its import needs
(engine/shims/sitecustomize.py), bf16 and unsplit chunked prefill chosen for it (engine/worker.py). The model is a
tiny random one built here (3 linear-attention + 1 full-attention layers, 1.2M parameters, the Qwen3.5-format
fixture's tokenizer and template): what is proven is the architecture's path, not a trained policy.

A private engine: no other test serves this model (and the suite's engines are fp32)."""

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

QWEN35 = Path("data/models/tiny-calc-qwen35")
pytestmark = pytest.mark.skipif(not (QWEN35 / "tokenizer.json").exists(), reason="needs the Qwen3.5-format tokenizer")


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory) -> str:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    tokenizer = AutoTokenizer.from_pretrained(QWEN35)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=2, num_key_value_heads=1,
        head_dim=64,  # vLLM's CPU paths take 64 and 128 wide heads (32: "Unexpected head dim size")
        linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=128, linear_value_head_dim=128,
        max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config)
    folder = tmp_path_factory.mktemp("qwen35-hybrid")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def lab(hybrid_model, tmp_path_factory):
    from polar_lab import Lab

    with Lab(hybrid_model, port=0, runs_dir=str(tmp_path_factory.mktemp("runs")), kv_cache_gib=0.25,
             max_model_len=2048) as lab:
        yield lab


def test_the_hybrid_architecture_serves_multi_turn_as_one_chain_and_its_logprobs_match_a_fp32_recomputation(
        lab, hybrid_model):
    import openai

    from polar_lab.grpo.loss import token_logprobs

    s = lab.session(sampling={"temperature": 0.7, "seed": 7})
    client = openai.OpenAI(base_url=s.openai_base_url, api_key=s.api_key, max_retries=0)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    for follow_up in ("And 4*5?", "Thanks."):
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=24)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "user", "content": follow_up}]
    client.chat.completions.create(model="m", messages=messages, max_tokens=24)
    calls = sorted(lab.call_records([s.id]), key=lambda c: c.call_index)
    assert len(calls) == 3 and lab.engine.model_name
    (chain,) = lab.trajectories(session_ids=[s.id])  # every later prompt extends the one before: one chain
    assert chain.token_ids == calls[-1].prompt_ids + calls[-1].output_ids
    # the engine (bf16, as vLLM's CPU GDN kernel requires) against transformers in fp32, on every sampled token at T=0.7
    model = AutoModelForCausalLM.from_pretrained(hybrid_model, dtype=torch.float32).eval()
    ids = torch.tensor([chain.token_ids])
    with torch.no_grad():
        trainer = token_logprobs(model, ids, torch.ones_like(ids), torch.tensor([0.7]))[0]
    sampled = [i for i, m in enumerate(chain.loss_mask) if m]
    gaps = [abs(trainer[i - 1].item() - chain.behavior_logprobs[i]) for i in sampled]
    mean, worst = sum(gaps) / len(gaps), max(gaps)
    tis = sum(math.exp(trainer[i - 1].item() - chain.behavior_logprobs[i]) for i in sampled) / len(sampled)
    print(f"{len(gaps)} tokens: mean |Δ| {mean:.2e}, max {worst:.2e}, TIS weight mean {tis:.4f}")
    assert len(gaps) >= 30 and mean <= 2e-3 and worst <= 1e-2, (mean, worst)
    assert sum(chain.behavior_logprobs[i] for i in sampled) / len(sampled) < -1  # not a model sure of every token
