"""Shared-prefix updates: the tokens every sample of an update begins with go through the model once, with exact
gradients. Owned by one `Policy.update` pass; holds the prefix's autograd graph until `backward()`.

A harness sends its whole system prompt and tool list on every call (Codex ~9.2k tokens, Qwen Code ~12k), so the
chains of a step share thousands of leading tokens and differ in a few hundred. The plain update runs each chain
from its first token. Here, for an update whose samples share a prefix of P tokens:

1. the prefix runs forward once, with gradients, filling a cache: each attention layer's keys and values, each
   linear-attention layer's last conv inputs and recurrent state;
2. each micro-batch runs only its suffixes (right-padded, positions from P on), from leaf copies of those cached
   tensors expanded to the micro-batch; its backward leaves the weights' gradients and the cache leaves' gradients;
3. after the last micro-batch, the prefix's graph is run backward once, with the leaves' summed gradients.

The gradient is the plain update's (the chain rule, split at the cache), not the truncated one that treats the
prompt as constant. Rounding differs only where the two paths sum in another order: `tests/grpo/test_shared_prefix.py`
compares them. Targets inside the prefix are never trained (the planner's condition); their logprobs, which the
X-ray shows, come from the prefix's hidden states at each row's temperature, without a support mask.

Supported: one process (no DDP/FSDP: their hooks expect one forward per micro-batch), no gradient checkpointing
(transformers turns the cache off under it), a plain lm_head (`TokenLogprobs.chunked`), and a model whose cache
layers are transformers' `DynamicLayer` (attention) and `LinearAttentionLayer` (Qwen3.5's Gated DeltaNet); other
models take the plain path.
"""

from __future__ import annotations

import functools

import torch

from polar_lab.grpo.batch import Sample

ALIGN = 64  # transformers' reference Gated DeltaNet kernel runs 64-token chunks: a prefix ending on a chunk
#            boundary chunks the suffix as the whole sequence would, so fewer sums change order


def shared_prefix_length(samples: list[Sample], min_tokens: int | None) -> int:
    """P: how many leading tokens the update may run once — tokens every sample has the same, before any trained
    target (target t is token t+1, and target P-1 is read from the prefix), rounded down to `ALIGN`; 0 when that is
    fewer than `min_tokens` (or `min_tokens` is None: never).

    >>> ids = torch.arange(300)
    >>> s = lambda tail, first: Sample(torch.cat([ids, tail]), torch.cat([torch.zeros(first), torch.ones(
    ...     len(ids) + len(tail) - 1 - first)]), 1.0, torch.zeros(1), torch.zeros(1), 1.0)
    >>> shared_prefix_length([s(torch.tensor([7, 8]), 300), s(torch.tensor([9]), 299)], 64)  # 299 = 4 × 64 + 43
    256
    >>> shared_prefix_length([s(torch.tensor([7, 8]), 300), s(torch.tensor([9]), 100)], 64)  # trained from 100 on
    64
    """
    if min_tokens is None or not samples:
        return 0
    first = samples[0].input_ids
    common = min(len(s.input_ids) for s in samples) - 1  # target P-1 (token P) must be the same for every row too
    for s in samples[1:]:
        differ = (s.input_ids[:common] != first[:common]).nonzero()
        common = min(common, int(differ[0]) if len(differ) else common)
    trained = min(int((s.weights > 0).nonzero()[0]) if bool((s.weights > 0).any()) else len(s.weights)
                  for s in samples)
    length = min(common - 1, trained) // ALIGN * ALIGN
    return length if length >= max(min_tokens, 1) else 0


POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")  # frequencies chosen from the forward's own largest position


def supported_by(model: torch.nn.Module) -> bool:
    """Whether `model`'s cache is made only of layers this module knows how to fill and read, and its rotary
    embedding rotates a position the same whatever else is in the forward."""
    try:
        from transformers.cache_utils import DynamicLayer, LinearAttentionLayer
    except ImportError:  # another transformers: the plain path
        return False
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) in POSITION_DEPENDENT_ROPE:
        return False
    return all(type(layer) in (DynamicLayer, LinearAttentionLayer) for layer in _new_cache(model.config).layers)


class SharedPrefix:
    """One update pass's shared prefix: run forward once at construction; `logprobs(mb)` per micro-batch; then
    `backward()` once, after every micro-batch's own backward."""

    @classmethod
    def of(cls, scorer, samples: list[Sample], min_tokens: int | None, device) -> SharedPrefix | None:
        """The samples' shared prefix, run forward now, when they begin with `min_tokens` (see
        `shared_prefix_length`) or more; else None."""
        length = shared_prefix_length(samples, min_tokens)
        return cls(scorer, samples[0].input_ids[:length + 1].to(device)) if length else None

    def __init__(self, scorer, ids: torch.Tensor):
        """`scorer`: the policy's `TokenLogprobs`; `ids`: (P+1,) the prefix's tokens and the token after it (the
        prefix's last target, the same in every sample), on the model's device."""
        self.scorer, self.ids, self.length = scorer, ids, len(ids) - 1
        cache = _new_cache(scorer.model.config)
        hidden = self._decoder(input_ids=ids[None, :-1], past_key_values=cache, use_cache=True).last_hidden_state
        self._hidden = hidden.detach()  # (1, P, H): the prefix targets' logprobs, never trained
        self._states = _states(cache)  # tensors that carry the prefix's graph (LoRA: not all of them)
        self._leaves = [s.detach().requires_grad_(s.requires_grad) for s in self._states]
        self._rows: dict[float, torch.Tensor] = {}

    def logprobs(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """The micro-batch's (B, T-1) token logprobs, as `TokenLogprobs(...)` gives them: the suffixes run from the
        cached prefix, with gradients to the weights and to the cache leaves."""
        ids, p = mb["input_ids"], self.length
        if not torch.equal(ids[:, :p + 1], self.ids.expand(len(ids), -1)):
            raise ValueError("a micro-batch that does not begin with the shared prefix")
        batch, width = ids.shape
        positions = torch.arange(p, width, device=ids.device).expand(batch, -1)  # (B, T-P)
        hidden = self._decoder(input_ids=ids[:, p:], attention_mask=mb["attention_mask"], position_ids=positions,
                               past_key_values=self._cache_for(batch), use_cache=True).last_hidden_state
        support = mb.get("support")
        suffix = self.scorer.head(hidden[:, :-1], ids[:, p + 1:], mb["temperature"],
                                  support[:, p:] if support is not None else None)  # (B, T-P-1)
        prefix = torch.stack([self._row(float(t)) for t in mb["temperature"]])  # (B, P)
        return torch.cat([prefix, suffix], dim=1)

    def backward(self) -> None:
        """The prefix's share of the gradient: its graph, run backward once with what every micro-batch sent to the
        cache leaves. Frees the graph."""
        pairs = [(s, leaf.grad) for s, leaf in zip(self._states, self._leaves)
                 if s.requires_grad and leaf.grad is not None]
        if pairs:
            torch.autograd.backward([s for s, _ in pairs], [g for _, g in pairs])
        self._states, self._leaves = [], []

    # ---- internals -------------------------------------------------------------------------------
    @property
    def _decoder(self):
        return self.scorer.model.get_decoder()

    def _cache_for(self, batch: int):
        """A cache holding the prefix for `batch` rows: views of the leaves, so each row's gradient sums into them."""
        cache = _new_cache(self.scorer.model.config)
        leaves = iter(self._leaves)
        for layer in cache.layers:
            if _is_linear(layer):
                conv, recurrent = next(leaves), next(leaves)
                layer.conv_states[0] = conv.expand(batch, *conv.shape[1:])
                layer.recurrent_states[0] = recurrent.expand(batch, *recurrent.shape[1:])
                layer.conv_kernel_size[0] = conv.shape[-1]
                layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
                layer.has_previous_state[0] = True
                layer.dtype, layer.device = conv.dtype, conv.device
            else:
                keys, values = next(leaves), next(leaves)
                layer.update(keys.expand(batch, *keys.shape[1:]), values.expand(batch, *values.shape[1:]))
        return cache

    def _row(self, temperature: float) -> torch.Tensor:
        """(P,) logprobs of the prefix's own targets at `temperature` (no gradient: they are never trained)."""
        if temperature not in self._rows:
            with torch.no_grad():
                temps = torch.tensor([temperature], device=self.ids.device)
                self._rows[temperature] = self.scorer.head(self._hidden, self.ids[None, 1:], temps)[0]
        return self._rows[temperature]


def _is_linear(layer) -> bool:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return isinstance(layer, LinearAttentionCacheLayerMixin)


def _states(cache) -> list[torch.Tensor]:
    """The cached tensors a later forward reads, layer by layer: (last conv inputs, recurrent state) of a linear
    layer — the conv keeps its kernel's width — and (keys, values) of an attention layer."""
    out = []
    for layer in cache.layers:
        if _is_linear(layer):
            out += [layer.conv_states[0][..., -layer.conv_kernel_size[0]:], layer.recurrent_states[0]]
        else:
            out += [layer.keys, layer.values]
    return out


@functools.cache
def _cache_class():
    from transformers import DynamicCache

    class PrefixCache(DynamicCache):
        """transformers' DynamicCache, but a linear-attention layer's states are replaced, never copied into: the
        stock cache writes them in place (a fixed address for CUDA graphs), which autograd refuses once the old state
        is saved for backward. Conv states use transformers' own `record_past` switch for the same."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for layer in self.layers:
                if _is_linear(layer):
                    layer.record_past = True

        def update_recurrent_state(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
            layer = self.layers[layer_idx]
            layer.recurrent_states[state_idx] = recurrent_states
            layer.is_recurrent_states_initialized[state_idx] = True
            return recurrent_states

    return PrefixCache


def _new_cache(config):
    return _cache_class()(config=config)
