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
    # safetensors lists names sorted; tied weights in vLLM take the last one loaded, so order is kept
    assert [name for name, _ in read_weights(tmp_path / "w")] == list(state)


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
