"""engine/gdn_fp32.py on its own: vLLM's step-by-step metadata (decodes first, then prefills; state slots; a prefill
that continues a state) against transformers' delta rule over each whole sequence, on a stand-in layer whose state
caches start full of another sequence's garbage. No engine: the engine's own acceptance test is
tests/engine/test_qwen35_hybrid.py (its logprobs against the trainer's)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from polar_lab.engine import gdn_fp32  # vLLM is a dependency: a failed import fails, not skips

K_HEADS, V_HEADS, K, V, WIDTH, SLOTS = 1, 2, 16, 16, 4, 6  # value heads twice the key heads: Qwen3.5's GQA repeat
DIM = 2 * K_HEADS * K + V_HEADS * V  # q, k, v as the conv sees them


class Layer:
    """The parts of vLLM's GatedDeltaNet layer the core reads: conv1d, A_log, dt_bias, the two state caches."""

    prefix, activation = "model.layers.0.linear_attn", "silu"

    def __init__(self, generator):
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        def rand(*shape, scale=1.0):
            return scale * torch.randn(*shape, generator=generator)

        self.conv1d = SimpleNamespace(weight=rand(DIM, 1, WIDTH, scale=0.5), bias=rand(DIM, scale=0.1))
        self.A_log, self.dt_bias = rand(V_HEADS, scale=0.5), rand(V_HEADS, scale=0.5)
        conv = rand(SLOTS, DIM, WIDTH - 1) if is_conv_state_dim_first() else rand(SLOTS, WIDTH - 1, DIM)
        self.kv_cache = [conv, rand(SLOTS, V_HEADS, V, K)]  # garbage: a new sequence must not read it

    def rearrange_mixed_qkv(self, mixed):
        q, k, v = mixed.split([K_HEADS * K, K_HEADS * K, V_HEADS * V], dim=-1)
        n = mixed.shape[0]
        return q.reshape(1, n, K_HEADS, K), k.reshape(1, n, K_HEADS, K), v.reshape(1, n, V_HEADS, V)


def reference(layer, x, b, a):
    """The whole sequence at once from zero state, as the trainer computes it: conv, gates, chunked delta rule."""
    w = layer.conv1d.weight
    conv = F.silu(F.conv1d(F.pad(x.t()[None], (WIDTH - 1, 0)), w, layer.conv1d.bias, groups=DIM))[0].t()
    q, k, v = layer.rearrange_mixed_qkv(conv)
    q, k = q.repeat_interleave(V_HEADS // K_HEADS, dim=2), k.repeat_interleave(V_HEADS // K_HEADS, dim=2)
    g = -layer.A_log.exp() * F.softplus(a + layer.dt_bias)
    out, _ = gdn_fp32.CHUNKED(q, k, v, g[None], b.sigmoid()[None], use_qk_l2norm_in_kernel=True)
    return out[0]  # (T, value heads, V)


# name: (slot, length); 70 crosses the chunked rule's 64-token chunk
SEQUENCES = {"a": (5, 12), "b": (2, 7), "c": (0, 71)}
# each step: decodes (name, position), then prefills (name, start, end, continues a state)
STEPS = [
    ([], [("a", 0, 10, False), ("b", 0, 5, False)]),
    ([("a", 10), ("b", 5)], [("c", 0, 40, False)]),
    ([("a", 11), ("b", 6)], [("c", 40, 70, True)]),  # the rest of a split prefill
    ([("c", 70)], []),
]


def run_steps(layer, inputs, steps):
    """The core over `steps`, as vLLM's scheduler would call it; each (name, position)'s output."""
    outputs = {}
    for decodes, prefills in steps:
        rows = [(n, p, p + 1) for n, p in decodes] + [(n, lo, hi) for n, lo, hi, _ in prefills]
        starts = torch.tensor([0] + [hi - lo for _, lo, hi in rows]).cumsum(0).to(torch.int32)
        meta = SimpleNamespace(
            num_decodes=len(decodes), num_prefills=len(prefills), num_actual_tokens=int(starts[-1]),
            non_spec_query_start_loc=starts, spec_sequence_masks=None, num_accepted_tokens=None,
            non_spec_state_indices_tensor=torch.tensor([SEQUENCES[n][0] for n, _, _ in rows], dtype=torch.int32),
            has_initial_state=torch.tensor([True] * len(decodes) + [c for *_, c in prefills]) if prefills else None)
        x, b, a = (torch.cat([inputs[n][i][lo:hi] for n, lo, hi in rows]) for i in range(3))
        out = torch.zeros(int(starts[-1]), V_HEADS, V)
        gdn_fp32._forward(layer, meta, x, b, a, out)
        row = 0
        for n, lo, hi in rows:
            for p in range(lo, hi):
                outputs[n, p] = out[row]
                row += 1
    return outputs


@pytest.fixture
def case():
    generator = torch.Generator().manual_seed(0)
    layer = Layer(generator)
    inputs = {n: (torch.randn(length, DIM, generator=generator), torch.randn(length, V_HEADS, generator=generator),
                  torch.randn(length, V_HEADS, generator=generator)) for n, (_, length) in SEQUENCES.items()}
    return layer, inputs


def test_steps_of_decodes_and_prefills_give_each_sequence_what_the_whole_sequence_gives(case):
    layer, inputs = case
    outputs = run_steps(layer, inputs, STEPS)
    for name, (_, length) in SEQUENCES.items():
        expected = reference(layer, *inputs[name])
        got = torch.stack([outputs[name, p] for p in range(length)])
        assert torch.allclose(got, expected, atol=1e-5), (name, (got - expected).abs().max().item())


def test_a_prefill_that_ignores_its_state_or_reads_a_stale_one_is_caught(case):
    """The negative controls: the split prefill taken as a fresh one, and a fresh prefill told to continue."""
    layer, inputs = case
    fresh = [(d, [(n, lo, hi, False) for n, lo, hi, _ in p]) for d, p in STEPS]
    stale = [(d, [(n, lo, hi, True) for n, lo, hi, _ in p]) for d, p in STEPS]
    for steps, wrong in ((fresh, "c"), (stale, "a")):
        outputs = run_steps(Layer(torch.Generator().manual_seed(0)), inputs, steps)
        length = SEQUENCES[wrong][1]
        got = torch.stack([outputs[wrong, p] for p in range(length)])
        assert not torch.allclose(got, reference(layer, *inputs[wrong]), atol=1e-3), wrong


def test_a_padding_state_slot_is_refused_not_read_as_the_last_slot(case):
    layer, inputs = case
    meta = SimpleNamespace(num_decodes=1, num_prefills=0, num_actual_tokens=1, has_initial_state=None,
                           non_spec_query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                           non_spec_state_indices_tensor=torch.tensor([-1], dtype=torch.int32))
    x, b, a = (t[:1] for t in inputs["a"])
    with pytest.raises(NotImplementedError, match="padding state slot"):
        gdn_fp32._forward(layer, meta, x, b, a, torch.zeros(1, V_HEADS, V))
