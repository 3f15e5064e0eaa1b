"""Weights that cross in memory (issue 45) on the shared real engine: a sync into the Lab's slot — written in place
through a standing mapping, read by the engine as views of its own — serves bit for bit what a fresh file serves; a
slot written again after its sync changes nothing the engine serves; a transfer that fails mid-way leaves the old
weights serving at the old version."""

import pytest
import torch

from polar_lab.engine.weights import is_slot, write_weights
from polar_lab.types import SamplingSpec

SPEC = SamplingSpec(max_tokens=24, temperature=0.7, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer.apply_chat_template([{"role": "user", "content": "What is 7*(8+9)?"}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def _moved(weights, seed: int) -> dict[str, torch.Tensor]:
    """Every floating tensor moved by noise (embeddings kept tied)."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=g) if v.is_floating_point() and v.numel() > 1
           else v.clone() for k, v in weights.items()}
    out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    return out


def _sample(lab, prompt_ids):
    gen = lab.engine.submit(prompt_ids, SPEC).result(timeout=300)
    return gen.output_ids, gen.output_logprobs


def test_an_in_memory_sync_serves_bit_for_bit_what_a_file_sync_serves(lab, prompt_ids, shipped_weights,
                                                                       restore_weights, tmp_path):
    moved = _moved(shipped_weights, 3)
    shipped = _sample(lab, prompt_ids)
    fresh = lab.weights_path(adapter=True)  # a fresh path, not a slot: the file transport
    write_weights(fresh, moved)
    by_file = lab.sync_weights(fresh)
    from_file = _sample(lab, prompt_ids)
    lab.sync_weights(shipped_weights)
    by_memory = lab.sync_weights(moved)
    from_memory = _sample(lab, prompt_ids)
    assert (by_file.path, by_memory.path) == ("shm-file", "shared-memory")
    assert from_memory == from_file  # ids and every logprob, float for float
    assert from_file != shipped  # negative control: the moved weights sample otherwise


def test_a_slot_written_again_after_its_sync_changes_nothing_the_engine_serves(lab, prompt_ids, shipped_weights,
                                                                               restore_weights):
    """The engine copies what it reads from a slot (into its standby, or its layers): the mapping it read is not
    part of the served model, so the trainer's next write into that slot is invisible until it is synced."""
    lab.sync_weights(_moved(shipped_weights, 4))
    served = _sample(lab, prompt_ids)
    slot = lab.weights_path()
    assert is_slot(slot)
    write_weights(slot, {k: torch.zeros_like(v) for k, v in shipped_weights.items()})  # written, not synced
    assert _sample(lab, prompt_ids) == served


class _FailsHalfway(dict):
    """A state dict whose transfer breaks after half its tensors are written (a rank lost mid-gather, memory run
    out): its first pass (the layout) goes through, its second (the tensors) stops halfway."""

    passes = 0
    written = 0

    def items(self):
        self.passes += 1
        for i, item in enumerate(super().items()):
            if self.passes > 1 and i == len(self) // 2:
                raise RuntimeError("rank 1 was lost mid-gather")
            self.written += self.passes > 1
            yield item


def test_a_transfer_that_fails_midway_leaves_the_old_weights_serving_at_the_old_version(
        lab, prompt_ids, shipped_weights, restore_weights):
    lab.sync_weights(_moved(shipped_weights, 5))
    version, served = lab.policy_version, _sample(lab, prompt_ids)
    broken = _FailsHalfway(_moved(shipped_weights, 6))
    with pytest.raises(RuntimeError, match="lost mid-gather"):
        lab.sync_weights(broken)
    assert broken.written == len(broken) // 2  # half of it had crossed
    assert lab.policy_version == version and _sample(lab, prompt_ids) == served
    assert lab.sync_weights(_moved(shipped_weights, 6)).policy_version == version + 1  # and the next one goes through
    assert _sample(lab, prompt_ids) != served


@pytest.fixture(scope="module")
def gloo_lab(model_path, tmp_path_factory):
    """A private engine: vLLM builds its weight-transfer engine with the LLM, so the backend is fixed at start."""
    from polar_lab import Lab

    with Lab(str(model_path), port=0, runs_dir=str(tmp_path_factory.mktemp("runs")), weights_transport="gloo") as lab:
        yield lab


def test_weights_through_vllms_transfer_api_serve_bit_for_bit_what_a_file_serves(gloo_lab, model_path, prompt_ids,
                                                                                  shipped_weights):
    """vLLM's protocol (init, start, update while the trainer broadcasts, finish) over the gloo stand-in of its NCCL
    backend, in buckets smaller than the model: the engine then samples what a file of the same weights gives it, at
    the next version each time, through one group opened at the first sync."""
    from polar_lab.engine.weight_transfer import PolicySource, WeightTransfer
    from polar_lab.grpo import GRPOConfig
    from polar_lab.grpo.policy import Policy

    lab = gloo_lab
    policy = Policy(str(model_path), GRPOConfig())
    policy.load_state_dict(_moved(shipped_weights, 7))
    fresh = lab.weights_path(adapter=True)
    write_weights(fresh, policy.state_dict())
    lab.sync_weights(fresh)
    from_file = _sample(lab, prompt_ids)
    lab.sync_weights(shipped_weights)
    assert _sample(lab, prompt_ids) != from_file  # the control: the shipped weights sample otherwise
    source = PolicySource(policy._layout(), policy._full_tensors, lab.engine.weights_dtype)
    transfer = WeightTransfer("gloo", source, lab.engine, bucket_bytes=256 * 1024)  # tiny-calc's 5 MB: ~20 buckets
    version = lab.policy_version
    first = lab.sync_weights(transfer)
    assert (first.path, first.policy_version, lab.engine.weights_file) == ("gloo", version + 1, None)
    assert _sample(lab, prompt_ids) == from_file
    assert lab.sync_weights(transfer).policy_version == version + 2  # the same group, a second update
    assert _sample(lab, prompt_ids) == from_file
    from polar_lab.grpo.policy import outgoing_weights

    assert isinstance(outgoing_weights(lab, policy, GRPOConfig()), WeightTransfer)  # what a trainer's sync sends here


def _transfer_of(lab, weights, source_class=None, **kw):
    from polar_lab.engine.weight_transfer import PolicySource, WeightTransfer

    layout = [(name, t.dtype, tuple(t.shape)) for name, t in weights.items()]
    source = (source_class or PolicySource)(layout, lambda: iter(weights.items()), lab.engine.weights_dtype)
    return WeightTransfer("gloo", source, lab.engine, bucket_bytes=256 * 1024, **kw)


def test_a_transfer_naming_a_tensor_the_engine_has_no_parameter_for_is_refused_before_anything_moves(
        gloo_lab, prompt_ids, shipped_weights):
    """vLLM's load passes over an unknown name in silence; the transfer is refused as a file load is."""
    from polar_lab.errors import EngineError

    lab = gloo_lab
    version, served, restarts = lab.policy_version, _sample(lab, prompt_ids), len(lab.engine_restarts)
    renamed = {("model.layers.0.mlp.gate_projection.weight" if k.endswith("mlp.gate_proj.weight") and ".0." in k
                else k): v for k, v in _moved(shipped_weights, 8).items()}
    with pytest.raises(EngineError, match="no parameter for 1 of the trainer's tensors"):
        lab.sync_weights(_transfer_of(lab, renamed))
    assert lab.engine.alive and len(lab.engine_restarts) == restarts
    assert lab.policy_version == version and _sample(lab, prompt_ids) == served


def test_a_transfer_that_fails_midway_ends_the_engine_and_the_lab_restarts_it_at_the_version_it_served(
        gloo_lab, prompt_ids, shipped_weights):
    """Half the buckets have crossed when the trainer's source fails: some layers hold new weights. The engine is
    ended rather than serve that mix; the Lab starts another from its kept copy (the last weights synced through a
    file), at the old version, sampling what it sampled before."""
    import time

    from polar_lab.engine.weight_transfer import PolicySource
    from polar_lab.errors import EngineError

    class FailsHalfway(PolicySource):
        def __iter__(self):
            for i, pair in enumerate(super().__iter__()):
                if i == len(self.layout) // 2:
                    raise RuntimeError("rank lost mid-gather")
                yield pair

    lab = gloo_lab
    lab.sync_weights(_moved(shipped_weights, 9))  # through the slot: the engine keeps a copy of these
    version, served, restarts = lab.policy_version, _sample(lab, prompt_ids), len(lab.engine_restarts)
    with pytest.raises(EngineError, match="mid-way"):
        lab.sync_weights(_transfer_of(lab, _moved(shipped_weights, 10), FailsHalfway))
    deadline = time.monotonic() + 120
    while not (len(lab.engine_restarts) == restarts + 1 and lab.engine.alive):
        assert time.monotonic() < deadline, "the Lab did not restart its engine"
        time.sleep(0.1)
    assert lab.policy_version == version and _sample(lab, prompt_ids) == served
