"""The weights file the trainer writes and the engine maps: safetensors that safetensors itself reads, written
tensor by tensor into a layout fixed up front, read back in the order written."""

import pytest
import torch
from safetensors.torch import load_file

from polar_lab.engine.weights import WeightsWriter, read_weights, remove_weights, weights_size, write_weights


def test_a_written_file_is_safetensors_and_reads_back_in_the_order_written(tmp_path):
    state = {"model.embed_tokens.weight": torch.randn(5, 3), "lm_head.weight": torch.randn(5, 3),
             "scale": torch.tensor(2.0, dtype=torch.bfloat16), "ids": torch.arange(4)}
    size = write_weights(tmp_path / "w", state)
    assert size == weights_size(tmp_path / "w") == (tmp_path / "w").stat().st_size
    loaded = load_file(str(tmp_path / "w"))  # safetensors' own reader
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in state.items())
    # safetensors lists names sorted; tied weights in vLLM take the last one loaded, so order is kept — within one
    # element size: the widest are written first, so every tensor is aligned to its element size
    assert [name for name, _ in read_weights(tmp_path / "w")] == ["ids", "model.embed_tokens.weight",
                                                                   "lm_head.weight", "scale"]


def test_a_tensor_that_does_not_fit_its_layout_or_is_missing_leaves_no_file(tmp_path):
    layout = [("a", torch.float32, (2, 2)), ("b", torch.float32, (3,))]
    with pytest.raises(ValueError, match="the layout says F32 \\(2, 2\\)"):
        with WeightsWriter(tmp_path / "w", layout) as out:
            out.write("a", torch.zeros(2, 3))
    assert not (tmp_path / "w").exists()
    out = WeightsWriter(tmp_path / "w", layout)
    out.write("a", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="1 tensors were never written"):
        out.close()  # b's bytes would be zeros
    assert not (tmp_path / "w").exists()


def test_an_adapter_folder_is_measured_and_removed_whole(tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    write_weights(folder / "adapter_model.safetensors", {"x": torch.ones(3)})
    assert weights_size(folder) == sum(f.stat().st_size for f in folder.iterdir())
    remove_weights(folder)
    remove_weights(folder)  # gone already is fine
    assert not folder.exists()


def test_a_file_that_has_the_layout_is_written_in_place_where_a_reader_mapped_it(tmp_path):
    """The slot path (WeightsWriter reuse): the same inode, and a mapping opened before the write (the engine's)
    sees the new values; another layout makes a new file."""
    from safetensors import safe_open

    path = tmp_path / "slot"
    write_weights(path, {"a": torch.zeros(4, 4), "n": torch.arange(3)})
    inode = path.stat().st_ino
    with safe_open(str(path), framework="pt") as reader:  # mapped now, read after the second write
        out = WeightsWriter(path, [("a", torch.float32, (4, 4)), ("n", torch.int64, (3,))])
        assert out.reused
        out.write("a", torch.full((4, 4), 7.0))
        out.write("n", torch.tensor([5, 6, 7]))
        out.close()
        assert torch.equal(reader.get_tensor("a"), torch.full((4, 4), 7.0))
    assert path.stat().st_ino == inode
    other = WeightsWriter(path, [("a", torch.float32, (2, 8)), ("n", torch.int64, (3,))])
    assert not other.reused  # another shape: written anew, not over the old header
    other.write("a", torch.ones(2, 8))
    other.write("n", torch.arange(3))
    other.close()
    assert load_file(str(path))["a"].shape == (2, 8)


def test_floating_matrices_are_stored_in_the_engines_dtype_as_the_engine_would_round_them(tmp_path):
    """dtype=bf16: a matrix holds what `tensor.to(bf16)` holds (the cast a bf16 engine's loader makes), bit for bit;
    vectors (an engine may keep them in fp32) and integer tensors keep their dtype. Half the bytes cross."""
    x = torch.randn(64, 33, generator=torch.Generator().manual_seed(0))
    state = {"x": x, "n": torch.arange(5), "a_log": torch.randn(7)}
    full = write_weights(tmp_path / "f32", state)
    half = write_weights(tmp_path / "bf16", state, dtype=torch.bfloat16)
    loaded = load_file(str(tmp_path / "bf16"))
    assert (loaded["x"].dtype, loaded["n"].dtype, loaded["a_log"].dtype) == (torch.bfloat16, torch.int64, torch.float32)
    assert torch.equal(loaded["x"].view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    assert half < full * 0.6


def test_a_labs_two_slots_alternate_around_the_served_one_and_close_removes_them():
    from polar_lab.engine.launch import WeightsFolder

    with WeightsFolder(keep=False) as folder:
        first = folder.slot(None)
        second = folder.slot(first)
        assert first != second and folder.slot(second) == first and folder.slot(None) == first
        first.write_bytes(b"x")
        where = first.parent
    assert not first.exists() and not where.exists()
    with WeightsFolder(keep=False, reuse=False) as folder:  # weights_transport="file": a fresh path each time
        assert folder.slot(None) != folder.slot(None)


def test_a_slots_tensors_are_read_as_views_of_one_standing_mapping(tmp_path):
    """What the engine reads from a slot: views of its mapping (a write after the read shows through them), the same
    mapping at the next read; tensors in the order written, each at its dtype and shape."""
    from polar_lab.engine.weights import SLOT_PREFIX, mapped, unmap

    path = tmp_path / f"{SLOT_PREFIX}0.safetensors"
    state = {"w": torch.randn(3, 5), "h": torch.randn(2).to(torch.bfloat16), "n": torch.arange(4)}
    write_weights(path, state)
    try:
        read = dict(read_weights(path))
        assert all(torch.equal(read[k], v) and read[k].dtype == v.dtype for k, v in state.items())
        write_weights(path, {**state, "w": torch.zeros(3, 5)})  # in place
        assert torch.equal(read["w"], torch.zeros(3, 5))  # a view, not a copy
        assert mapped(path) is mapped(path)
    finally:
        unmap(path)
