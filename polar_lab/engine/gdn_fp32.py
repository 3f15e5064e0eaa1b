"""A Gated-DeltaNet core for an fp32 engine on CPU, so that a hybrid model (Qwen3.5) is served in the trainer's dtype.

vLLM's CPU path for the linear-attention layers (`cpu_gdn_attention_core` in
vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py) takes bf16 only: its C++ gating and delta-rule kernels
refuse fp32 ("Unsupported floating data type"). A bf16 engine is off from the fp32 trainer by the rounding of every
activation: on the hybrid fixture a mean |Δ logprob| of 2.4e-3 and a max of 7.7e-2 (benchmarks/hybrid_fidelity.py),
more than rounding the weights alone (9e-4 / 3.5e-2); no engine-side change short of fp32 closes that.

`install()` registers, in place of vLLM's function and before its first layer registers it, one that computes fp32
inputs with transformers' own delta-rule functions (the ones the trainer runs, `torch_chunk_gated_delta_rule` and
`torch_recurrent_gated_delta_rule`) and vLLM's own torch causal conv, reading and writing vLLM's conv and recurrent
state caches as its kernels do; bf16/fp16 inputs go to vLLM's function unchanged. Only the engine process calls it,
and only for a hybrid model served in fp32 on CPU (engine/worker.py). Not covered: speculative decoding (vLLM's
wide-buffer path; refused with a clear error). Speed: on the 2-core AVX2 machine (no native bf16) the fixture's GRPO
run took 118-125 s with this core against 189 s with vLLM's bf16 kernels (docs/benchmarks.md); on a CPU with native
bf16 (AVX-512 BF16, AMX) vLLM's kernels may be the faster ones, not measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention
from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu
from vllm.utils.torch_utils import LayerNameType, _resolve_layer_name

_ORIGINAL = None


def install() -> None:
    """Put the fp32 core in vLLM's place, before any hybrid layer registers vLLM's custom op (idempotent)."""
    global _ORIGINAL
    if _ORIGINAL is not None:
        return
    if gdn_attention._CPU_GDN_ATTENTION_OPS_REGISTERED:
        raise RuntimeError("vLLM's CPU GDN op is already registered in this process: install() must run before "
                           "the model is built")
    _ORIGINAL = gdn_attention.cpu_gdn_attention_core
    gdn_attention.cpu_gdn_attention_core = core


def core(mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, core_attn_out: torch.Tensor,
         layer_name: LayerNameType) -> None:
    """vLLM's `cpu_gdn_attention_core` contract: writes this step's linear-attention output into `core_attn_out`
    and advances the conv and recurrent states of the step's sequences. fp32 here; anything else goes to vLLM's."""
    if mixed_qkv.dtype != torch.float32:
        return _ORIGINAL(mixed_qkv, b, a, core_attn_out, layer_name)
    context = get_forward_context()
    layer = context.no_compile_layers[_resolve_layer_name(layer_name)]
    if context.attn_metadata is None:
        return
    meta = context.attn_metadata[layer.prefix]
    if meta.num_actual_tokens == 0:
        return
    if meta.spec_sequence_masks is not None or meta.num_accepted_tokens is not None:
        raise NotImplementedError("the fp32 GDN core does not serve speculative decoding")
    _forward(layer, meta, mixed_qkv.contiguous(), b.contiguous(), a.contiguous(), core_attn_out)


def _forward(layer, meta, mixed_qkv, b, a, out) -> None:
    """Decode tokens first, then prefills, as vLLM orders a step's sequences; states at the slots it assigns."""
    decodes, prefills = meta.num_decodes, meta.num_prefills
    sequences = decodes + prefills
    starts = meta.non_spec_query_start_loc[: sequences + 1]
    slots = meta.non_spec_state_indices_tensor[:sequences].long()
    # a decode always continues its state; a prefill where vLLM kept one (a prefix-cache hit or a split prefill: on
    # CPU a hybrid runs with neither, engine/worker.py, so each prompt starts from zeros)
    continues = torch.ones(sequences, dtype=torch.bool)
    if prefills:
        continues[decodes:] = meta.has_initial_state[decodes:sequences]
    tokens = int(starts[-1])

    conv_state = layer.kv_cache[0] if is_conv_state_dim_first() else layer.kv_cache[0].transpose(-1, -2)
    weight = getattr(layer.conv1d, "_cpu_unpacked_conv_weight", None)  # vLLM packs it on AVX-512 BF16 CPUs
    if weight is None:
        weight = layer.conv1d.weight.view(layer.conv1d.weight.size(0), layer.conv1d.weight.size(2))
    mixed = causal_conv1d_fn_cpu(mixed_qkv[:tokens].transpose(0, 1), weight, layer.conv1d.bias, conv_state,
                                 starts, cache_indices=slots, has_initial_state=continues,
                                 activation=layer.activation).transpose(0, 1)
    query, key, value = layer.rearrange_mixed_qkv(mixed)  # (1, tokens, heads, dim)
    beta = b[:tokens].float().sigmoid()  # as transformers' Qwen3_5GatedDeltaNet.forward computes them
    g = -layer.A_log.float().exp() * F.softplus(a[:tokens].float() + layer.dt_bias)
    repeat = value.shape[2] // query.shape[2]
    if repeat > 1:
        query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)

    state = layer.kv_cache[1]
    heads, v_dim, k_dim = state.shape[1:]
    state = state.view(state.size(0), heads, k_dim, v_dim)  # vLLM's kernels read the same memory this way
    if decodes:  # one token each: a batch of single recurrent steps
        idx = slots[:decodes]
        o, new = torch_recurrent_gated_delta_rule(
            *(x[0, :decodes].unsqueeze(1) for x in (query, key, value)), g[:decodes].unsqueeze(1),
            beta[:decodes].unsqueeze(1), initial_state=state[idx], output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        state[idx] = new.to(state.dtype)
        out[:decodes] = o[:, 0].to(out.dtype)
    for i in range(decodes, sequences):
        lo, hi, slot = int(starts[i]), int(starts[i + 1]), int(slots[i])
        initial = state[slot : slot + 1] if continues[i] else None
        o, new = torch_chunk_gated_delta_rule(
            query[:, lo:hi], key[:, lo:hi], value[:, lo:hi], g[None, lo:hi], beta[None, lo:hi],
            initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
        state[slot] = new[0].to(state.dtype)
        out[lo:hi] = o[0].to(out.dtype)
