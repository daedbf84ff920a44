"""A Hugging Face folder whose weights are sharded `pytorch_model.bin` files with
`pytorch_model.bin.index.json` (what transformers 4 wrote with `max_shard_size` before safetensors
was its default) converts, each shard through PyTorch's weights-only unpickler as a single
`pytorch_model.bin` is (issue 56 item 15); a shard that would run code is refused before it runs.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the shards are PyTorch files")
transformers = pytest.importorskip("transformers", reason="the folder is written by transformers' save_pretrained")

from conformance.cli import main  # noqa: E402
from conformance.convert import from_hf_folder  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from conformance.core.errors import CheckpointError  # noqa: E402
from systems import randomize_  # noqa: E402


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the folder as save_pretrained writes it, the same weights as two .bin shards with their index)."""
    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=23, d_model=8, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=12,
                                     decoder_ffn_dim=12, max_position_embeddings=16)
    model = randomize_(transformers.BartForConditionalGeneration(config).eval(), 4, buffers=("final_logits_bias",))
    root = tmp_path_factory.mktemp("sharded-bin")
    model.save_pretrained(root / "safetensors")
    sharded = root / "sharded"
    sharded.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(root / "safetensors" / name, sharded / name)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: saved once
    keys = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": keys[: len(keys) // 2],
              "pytorch_model-00002-of-00002.bin": keys[len(keys) // 2:]}
    for shard, names in shards.items():
        torch.save({k: state[k].clone() for k in names}, sharded / shard)
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in state.values())},
         "weight_map": {k: shard for shard, names in shards.items() for k in names}}))
    return root / "safetensors", sharded


def test_a_sharded_bin_folder_converts_to_the_same_checkpoint(folders, tmp_path, capsys):
    whole, sharded = folders
    expected_config, expected = from_hf_folder(whole)
    config, params = from_hf_folder(sharded)
    assert config == expected_config and sorted(params) == sorted(expected)
    assert all(np.array_equal(params[k], expected[k]) for k in expected)
    out = tmp_path / "bart.safetensors"
    assert main(["convert", str(sharded), str(out)]) == 0, capsys.readouterr().err
    assert "verified: checkpoint.load" in capsys.readouterr().out
    loaded_config, loaded = checkpoint.load(out)
    assert loaded_config == expected_config and all(np.array_equal(loaded[k], expected[k]) for k in expected)


def test_a_shard_the_index_misplaces_is_refused(folders, tmp_path):
    _, sharded = folders
    copy = tmp_path / "copy"
    shutil.copytree(sharded, copy)
    index = json.loads((copy / "pytorch_model.bin.index.json").read_text())
    moved = next(iter(index["weight_map"]))
    index["weight_map"][moved] = "pytorch_model-00002-of-00002.bin" if index["weight_map"][moved].startswith(
        "pytorch_model-00001") else "pytorch_model-00001-of-00002.bin"
    (copy / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"holds '{moved}', which the index places in"):
        from_hf_folder(copy)


class Exploit:
    """Unpickling this runs `os.system(...)`: exactly what weights_only=True must refuse."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_shard_that_would_run_code_is_refused_before_it_runs(folders, tmp_path, capsys):
    _, sharded = folders
    copy = tmp_path / "hostile"
    shutil.copytree(sharded, copy)
    marker = tmp_path / "exploited"
    shard = copy / "pytorch_model-00002-of-00002.bin"
    torch.save({**torch.load(shard, weights_only=True), "trap": Exploit(marker)}, shard)
    assert main(["convert", str(copy), str(tmp_path / "out.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"{shard}: refused" in err and "posix.system" in err, err
    assert not marker.exists(), "the shard's pickle ran"
    assert not (tmp_path / "out.safetensors").exists()
