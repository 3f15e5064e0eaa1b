"""A Gated-DeltaNet core for an fp32 engine on CPU, so that a hybrid model (Qwen3.5) is served in the trainer's dtype.
Owns one thing: vLLM's `cpu_gdn_attention_core` name in this process, replaced by `core` (`install`; the original
kept in `_ORIGINAL`). Everything else it reads and writes belongs to vLLM (the layer, its state caches).

vLLM's CPU path for the linear-attention layers (`cpu_gdn_attention_core` in
vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py) takes bf16 only: its C++ gating and delta-rule kernels
refuse fp32 ("Unsupported floating data type"), and a bf16 engine is off from the fp32 trainer by more than issue 41
allows (docs/design-notes.md, "Qwen3.5's architecture").

`install()` registers, in place of vLLM's function and before its first layer registers it, one that computes fp32
inputs with transformers' own delta-rule functions (the ones the trainer runs, `torch_chunk_gated_delta_rule` and
`torch_recurrent_gated_delta_rule`, their torch code even where a kernel package would replace them) and vLLM's own
torch causal conv, reading and writing vLLM's conv and recurrent state caches as its kernels do; bf16/fp16 inputs go
to vLLM's function unchanged. Only the engine process calls it, and only for a hybrid model served in fp32 on CPU
(engine/worker.py). Not covered: speculative decoding (vLLM's wide-buffer path; refused with a clear error). What it
costs against vLLM's kernels: docs/benchmarks.md.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention
from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_fn_cpu
from vllm.utils.torch_utils import LayerNameType, _resolve_layer_name

_ORIGINAL = None
# transformers wraps them to call a kernel package (fla) where one is installed: its Triton kernels, not for CPU
CHUNKED = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
RECURRENT = inspect.unwrap(modeling_qwen3_5.torch_recurrent_gated_delta_rule)


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
    if bool((slots < 0).any()):  # vLLM's padding slot: its C++ kernels skip it, state[-1] would be another's
        raise NotImplementedError(f"the fp32 GDN core got a padding state slot: {slots.tolist()}")
    # a decode always continues its state; a prefill where vLLM kept one (a prefix-cache hit, whose state vLLM's
    # 'align' mode copied into this slot, or a split prefill's earlier chunk); any other starts from zeros
    continues = torch.ones(sequences, dtype=torch.bool)
    if prefills:
        continues[decodes:] = meta.has_initial_state[decodes:sequences]
    tokens = int(starts[-1])

    # (slots, dim, width - 1); the weight (dim, 1, width) as (dim, width): vLLM packs only bf16 ones (layers/utils.py)
    conv_state = layer.kv_cache[0] if is_conv_state_dim_first() else layer.kv_cache[0].transpose(-1, -2)
    weight = layer.conv1d.weight.view(layer.conv1d.weight.size(0), layer.conv1d.weight.size(2))
    mixed = causal_conv1d_fn_cpu(mixed_qkv[:tokens].transpose(0, 1), weight, layer.conv1d.bias, conv_state,
                                 starts, cache_indices=slots, has_initial_state=continues,
                                 activation=layer.activation).transpose(0, 1)
    query, key, value = layer.rearrange_mixed_qkv(mixed)  # (1, tokens, heads, dim)
    beta = b[:tokens].float().sigmoid()  # (tokens, value heads), as transformers' Qwen3_5GatedDeltaNet.forward has them
    g = -layer.A_log.float().exp() * F.softplus(a[:tokens].float() + layer.dt_bias)
    repeat = value.shape[2] // query.shape[2]
    if repeat > 1:
        query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)

    state = layer.kv_cache[1]
    heads, v_dim, k_dim = state.shape[1:]
    state = state.view(state.size(0), heads, k_dim, v_dim)  # (slots, value heads, k, v), as vLLM's kernels read it
    if decodes:  # one token each: a batch of single recurrent steps
        idx = slots[:decodes]
        o, new = RECURRENT(
            *(x[0, :decodes].unsqueeze(1) for x in (query, key, value)), g[:decodes].unsqueeze(1),
            beta[:decodes].unsqueeze(1), initial_state=state[idx], output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        state[idx] = new.to(state.dtype)
        out[:decodes] = o[:, 0].to(out.dtype)
    for i in range(decodes, sequences):
        lo, hi, slot = int(starts[i]), int(starts[i + 1]), int(slots[i])
        initial = state[slot : slot + 1] if continues[i] else None
        o, new = CHUNKED(
            query[:, lo:hi], key[:, lo:hi], value[:, lo:hi], g[None, lo:hi], beta[None, lo:hi],
            initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
        state[slot] = new[0].to(state.dtype)
        out[lo:hi] = o[0].to(out.dtype)
