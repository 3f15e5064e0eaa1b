"""Shared-prefix updates (grpo/prefix.py): an update whose samples begin with the same long prompt runs it once and
gets the plain update's gradient — on Qwen3.5's hybrid (Gated DeltaNet + attention), on a pure-attention model, with
LoRA — across several micro-batches and temperatures; where it cannot share, the plain path runs."""

import pytest
import torch

from polar_lab.grpo import GRPOConfig
from polar_lab.grpo.batch import Sample
from polar_lab.grpo.policy import Policy
from polar_lab.grpo.prefix import ALIGN

PREFIX = 330  # shared tokens; the update runs 320 of them once (5 chunks of 64)


def _samples(vocab: int, *, seed: int = 0) -> list[Sample]:
    """Seven chains of one prompt: suffixes of 40–160 tokens, each partly trained, advantages of both signs, two
    temperatures; the prompt's tokens ids, never trained."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (PREFIX,), generator=g)
    out = []
    for i, n in enumerate((40, 160, 75, 120, 60, 100, 90)):
        ids = torch.cat([prompt, torch.randint(3, vocab, (n,), generator=g)])
        weights = torch.zeros(len(ids) - 1)
        weights[PREFIX + n // 3:] = 1.0 / 500  # the suffix's last two thirds: the policy's tokens
        out.append(Sample(input_ids=ids, weights=weights, advantage=(-1.0) ** i * (0.5 + i / 10),
                          behavior_logprobs=torch.where(weights > 0, -torch.rand(len(weights), generator=g) * 3, 0.0),
                          versions=torch.zeros(len(weights), dtype=torch.long),
                          temperature=(1.0, 0.7)[i % 2], session_id=f"r{i}"))
    return out


def _gradients(model_path: str, samples: list[Sample], **config) -> tuple[dict, object]:
    base = dict(micro_batch_size=3, learning_rate=1e-3, max_grad_norm=None, loss_type="dapo")
    policy = Policy(model_path, GRPOConfig(**{**base, **config}))
    stats = policy.update(samples)
    return policy.gradients(), stats


def _attention_only(tmp_path) -> str:
    """A random two-layer Qwen3 (attention only), saved as a model folder."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         max_position_embeddings=2048, pad_token_id=0))
    model.save_pretrained(tmp_path / "qwen3-attention")
    return str(tmp_path / "qwen3-attention")


# name: (model, extra config)
CASES = {
    "hybrid": ("data/models/tiny-agent", {}),  # 3 Gated DeltaNet layers (conv + recurrent state), 1 attention
    "attention": (None, {}),  # keys and values only
    "lora": ("data/models/tiny-agent", {"peft_config": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}}),
    # adapters on the attention's q and v only: layer 0's cached keys and every DeltaNet state carry no gradient
    "lora q, v": ("data/models/tiny-agent", {"peft_config": {"r": 4, "lora_alpha": 8,
                                                            "target_modules": ["q_proj", "v_proj"]}}),
}


@pytest.mark.parametrize("case", CASES)
def test_an_update_that_runs_the_shared_prompt_once_has_the_plain_updates_gradient(case, tmp_path):
    path, extra = CASES[case]
    path = path or _attention_only(tmp_path)
    samples = _samples(512)
    plain, plain_stats = _gradients(path, samples, shared_prefix_min_tokens=None, **extra)
    shared, shared_stats = _gradients(path, samples, shared_prefix_min_tokens=256, **extra)
    assert (plain_stats.shared_prefix_tokens, shared_stats.shared_prefix_tokens) == (0, PREFIX // ALIGN * ALIGN)
    assert shared.keys() == plain.keys() and plain
    total = torch.sqrt(sum(g.norm() ** 2 for g in plain.values()))
    gap = torch.sqrt(sum((shared[n] - g).norm() ** 2 for n, g in plain.items()))
    # fp32, summed in another order (the prefix's share once instead of per row); the Gated DeltaNet's decay
    # parameters (A_log, dt_bias) sum thousands of cumulative products and carry most of the gap
    assert gap <= 1e-5 * total, f"shared vs plain: {gap:.3e} of {total:.3e}"
    for name, g in plain.items():  # each tensor too (a piece of the model left out would be off by ~100%); A_log's
        assert (shared[name] - g).norm() <= 1e-2 * g.norm() + 1e-9, name  # gradient is ~1e-5, cancelling, ~1e-3 off
    assert shared_stats.loss == pytest.approx(plain_stats.loss, rel=1e-6, abs=1e-9)
    assert shared_stats.tokens == plain_stats.tokens


def test_the_prefix_carries_gradient_the_update_would_lose_if_it_were_held_constant(tmp_path):
    """The negative control of the test above: the prompt's own share of the gradient is large, so an update that
    dropped it (truncated backprop through the prompt) would fail there."""
    from polar_lab.grpo import prefix

    samples = _samples(512)
    plain, _ = _gradients("data/models/tiny-agent", samples, shared_prefix_min_tokens=None)
    original = prefix.SharedPrefix.backward
    prefix.SharedPrefix.backward = lambda self: None  # the prompt held constant
    try:
        truncated, stats = _gradients("data/models/tiny-agent", samples, shared_prefix_min_tokens=256)
    finally:
        prefix.SharedPrefix.backward = original
    assert stats.shared_prefix_tokens
    total = torch.sqrt(sum(g.norm() ** 2 for g in plain.values()))
    gap = torch.sqrt(sum((truncated[n] - g).norm() ** 2 for n, g in plain.items()))
    assert gap > 1e-2 * total


# name: (config, why the plain path runs)
PLAIN = {
    "checkpointing": ({"gradient_checkpointing": True}, "transformers turns the cache off under it"),
    "short prompt": ({"shared_prefix_min_tokens": 1024}, "320 shared tokens < 1024"),
}


@pytest.mark.parametrize("case", PLAIN)
def test_where_the_prompt_cannot_be_shared_the_update_runs_each_chain_whole(case):
    config, _ = PLAIN[case]
    _, stats = _gradients("data/models/tiny-agent", _samples(512)[:3], **config)
    assert stats.shared_prefix_tokens == 0 and stats.tokens > 0


def test_the_shared_paths_logprobs_are_the_whole_sequences():
    """Every target's logprob, the prompt's own included (the X-ray shows them), at each row's temperature, within
    fp32 rounding: the suffixes' attention and chunked delta rule sum in another order than one pass does."""
    from polar_lab.grpo.batch import collate
    from polar_lab.grpo.prefix import SharedPrefix, shared_prefix_length

    policy = Policy("data/models/tiny-agent", GRPOConfig())
    samples = _samples(512)
    length = shared_prefix_length(samples, 256)
    mb = collate(samples, policy.pad_id, "cpu")
    with torch.no_grad():
        whole = policy.train_model(mb["input_ids"], mb["attention_mask"], mb["temperature"])
        shared = SharedPrefix(policy.train_model, samples[0].input_ids[:length + 1]).logprobs(mb)
    real = mb["attention_mask"][:, 1:].bool()
    assert shared.shape == whole.shape
    torch.testing.assert_close(shared[real], whole[real], rtol=0, atol=3e-5)


def _chain(first_difference: int, first_trained: int, length: int = 400, *, other: bool) -> Sample:
    ids = torch.arange(length)
    if other:
        ids[first_difference:] += 1000  # differs from the reference chain from this token on
    weights = torch.zeros(length - 1)
    weights[first_trained:] = 1.0
    return Sample(ids, weights, 1.0, torch.zeros(length - 1), torch.zeros(length - 1, dtype=torch.long), 1.0)


# name: (first token that differs between the two chains, first trained target, P)
BOUNDARIES = {
    "chains differ at token 192": (192, 300, 128),  # tokens 0..P must agree: P ≤ 191, rounded down to 128
    "chains differ at token 193": (193, 300, 192),  # P = 192: token 192 still agrees
    "trained from target 192": (300, 192, 192),  # targets 0..P-1 untrained: P ≤ 192
    "trained from target 191": (300, 191, 128),
}


@pytest.mark.parametrize("case", BOUNDARIES)
def test_the_prefix_stops_before_the_first_difference_and_the_first_trained_target(case):
    from polar_lab.grpo.prefix import shared_prefix_length

    differ, trained, expected = BOUNDARIES[case]
    chains = [_chain(differ, trained, other=False), _chain(differ, trained, other=True)]
    assert shared_prefix_length(chains, 64) == expected
    assert shared_prefix_length(chains, expected + 1) == 0  # under the minimum: not shared


def test_a_rotary_embedding_that_depends_on_the_forwards_length_is_not_shared():
    """Dynamic NTK and LongRoPE pick their frequencies from the forward's largest position: the prompt alone would be
    rotated otherwise than inside the whole chain."""
    from types import SimpleNamespace

    from transformers import Qwen3Config

    from polar_lab.grpo.prefix import supported_by

    def model(rope: dict):
        return SimpleNamespace(config=Qwen3Config(num_hidden_layers=1, rope_parameters={"rope_theta": 1e4, **rope}))

    assert supported_by(model({"rope_type": "default"}))
    assert not supported_by(model({"rope_type": "dynamic", "factor": 2.0}))
