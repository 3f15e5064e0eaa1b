"""The direct standby load's pieces that need no engine (engine/direct_load.py): where a file tensor lands, how fused
parts are stacked, and what it refuses. Its result on the real engine — bit for bit vLLM's in-place reload, and no view
of the slot kept — is proven in tests/engine/test_standby.py."""

import pytest
import torch

from polar_lab.engine import direct_load


class _Model(torch.nn.Module):
    """Stands in for a vLLM model class: only its checkpoint mapper and fused-layer table are read."""

    def __init__(self, mapper=None, packed=None):
        super().__init__()
        self.hf_to_vllm_mapper = mapper
        self.packed_modules_mapping = packed


def test_a_file_tensor_lands_in_its_fused_layer_at_its_part():
    from vllm.model_executor.models.utils import WeightsMapper

    # Qwen3's mapper names the shard itself (q/k/v, 0/1); a model without one is read from its fused-layer table
    stacked = _Model(WeightsMapper(orig_to_new_stacked={".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"),
                                                        ".v_proj": (".qkv_proj", "v"),
                                                        ".gate_proj": (".gate_up_proj", 0),
                                                        ".up_proj": (".gate_up_proj", 1)}))
    table = _Model(packed={"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]})
    for model in (stacked, table):
        assert direct_load.target_of(model, "model.layers.3.self_attn.v_proj.weight") == (
            "model.layers.3.self_attn.qkv_proj.weight", 2)
        assert direct_load.target_of(model, "model.layers.0.mlp.up_proj.weight") == (
            "model.layers.0.mlp.gate_up_proj.weight", 1)
        assert direct_load.target_of(model, "model.norm.weight") == ("model.norm.weight", 0)
    dropping = _Model(WeightsMapper(orig_to_new_prefix={"vision.": None}))
    with pytest.raises(direct_load.Unsupported, match="drops"):
        direct_load.target_of(dropping, "vision.patch.weight")


def test_parts_that_lie_back_to_back_are_stacked_as_a_view_others_as_a_copy():
    buffer = torch.arange(24, dtype=torch.float32)
    q, k, v = buffer[:12].view(4, 3), buffer[12:18].view(2, 3), buffer[18:].view(2, 3)  # as a slot holds them
    stacked = direct_load._stacked([q, k, v])
    assert torch.equal(stacked, torch.cat([q, k, v]))
    assert stacked.data_ptr() == buffer.data_ptr()  # no copy
    apart = direct_load._stacked([q, v, k])  # v then k: not in the buffer's order
    assert torch.equal(apart, torch.cat([q, v, k]))
    assert apart.data_ptr() != buffer.data_ptr()
    gap = direct_load._stacked([buffer[:6].view(2, 3), buffer[9:15].view(2, 3)])  # a tensor between them
    assert torch.equal(gap, torch.cat([buffer[:6], buffer[9:15]]).view(4, 3))


def test_a_model_class_it_does_not_know_is_refused_before_anything_is_written():
    model = _Model()
    model.norm = torch.nn.Linear(2, 2)
    before = model.norm.weight.detach().clone()
    with pytest.raises(direct_load.Unsupported, match="_Model is not one of the classes"):
        direct_load.load(model, {"norm.weight": torch.zeros(2, 2)})
    assert torch.equal(model.norm.weight, before)


def test_a_fused_layers_parts_must_have_its_own_sizes_not_only_its_total():
    from types import SimpleNamespace

    qkv = direct_load.Step(SimpleNamespace(input_size_per_partition=3, output_size_per_partition=8,
                                           output_sizes=[4, 2, 2]), "linear")
    direct_load.check(qkv, "weight", [(4, 3), (2, 3), (2, 3)], "qkv_proj.weight")
    with pytest.raises(direct_load.Unsupported, match="are not its"):  # 8 rows in all, but k took one of q's
        direct_load.check(qkv, "weight", [(3, 3), (3, 3), (2, 3)], "qkv_proj.weight")
    embedding = direct_load.Step(SimpleNamespace(weight=torch.zeros(6, 3)), "embedding")
    with pytest.raises(direct_load.Unsupported, match="are not its"):  # fewer rows than its vocabulary
        direct_load.check(embedding, "weight", [(5, 3)], "embed_tokens.weight")


def test_a_tied_tensor_is_copied_once_from_the_heads_name_and_only_when_that_name_comes_later():
    embed, head = torch.nn.Module(), torch.nn.Module()
    embed.weight = head.weight = torch.nn.Parameter(torch.zeros(2, 2))
    norm = torch.nn.Module()
    norm.weight = torch.nn.Parameter(torch.zeros(2))
    steps = [direct_load.Step(embed, "embedding", {"weight": ["model.embed_tokens.weight"]}),
             direct_load.Step(head, "embedding", {"weight": ["lm_head.weight"]}),
             direct_load.Step(norm, "copy", {"weight": ["model.norm.weight"]})]
    order = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert [name for name, _, _ in direct_load._copies(steps, order, head)] == ["model.norm.weight", "lm_head.weight"]
    with pytest.raises(direct_load.Unsupported, match="the head's is not the later one"):
        direct_load._copies(steps, ["lm_head.weight", "model.norm.weight", "model.embed_tokens.weight"], head)
