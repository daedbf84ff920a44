"""The silent traps a newcomer met (issue 16), each now said out loud.

- `pad_id` is required where the tensors cannot tell it (torch-nn-transformer), and taken from
  the one place they can: an all-zero embedding row, the mark of `nn.Embedding(padding_idx=N)`;
  a given pad id that contradicts that row is warned about.
- `rosetta convert` runs one small forward pass after converting and warns on non-finite logits.
- `rosetta generate` says which form of `--src` it read, and stops each row at its EOS.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the traps are in PyTorch imports")

import impl_numpy  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.convert import convert_arrays, from_torch_nn_transformer  # noqa: E402
from conformance.convert.engine import PaddingWarning  # noqa: E402
from conformance.core import checkpoint, init_params  # noqa: E402
from conformance.core.config import ModelConfig  # noqa: E402
from conformance.core.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor:UserWarning")


def wrapper(padding_idx=None, seed=0):
    """A user's own nn.Transformer wrapper: (transformer, src embedding, tgt embedding, generator)."""
    torch.manual_seed(seed)
    transformer = torch.nn.Transformer(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                       dim_feedforward=16, dropout=0.0).eval()
    src = torch.nn.Embedding(40, 8, padding_idx=padding_idx)
    tgt = torch.nn.Embedding(45, 8, padding_idx=padding_idx)
    return transformer, src, tgt, torch.nn.Linear(8, 45)


def tutorial_state(padding_idx=None) -> dict[str, np.ndarray]:
    transformer, src, tgt, generator = wrapper(padding_idx)
    state = {f"transformer.{k}": v for k, v in transformer.state_dict().items()}
    state |= {"src_tok_emb.embedding.weight": src.weight, "tgt_tok_emb.embedding.weight": tgt.weight,
              "generator.weight": generator.weight, "generator.bias": generator.bias}
    return {k: v.detach().numpy().copy() for k, v in state.items()}


def test_pad_id_is_required_when_the_tensors_cannot_tell_it():
    with pytest.raises(ConfigError) as info:
        from_torch_nn_transformer(*wrapper())
    assert info.value.field == "pad_id" and "pad_id=... in Python" in str(info.value)
    config, _ = from_torch_nn_transformer(*wrapper(), pad_id=0)
    assert config.pad_id == 0


def test_an_all_zero_embedding_row_tells_the_pad_id():
    config, _ = from_torch_nn_transformer(*wrapper(padding_idx=3))
    assert config.pad_id == 3
    result = convert_arrays(tutorial_state(padding_idx=3), "torch-nn-transformer", norm_placement="post", n_heads=2, max_len=16)
    assert result.config.pad_id == 3
    assert any(line.startswith("pad_id=3 (read from the weights: row 3 of both token embeddings is all zeros")
               for line in result.decisions), result.decisions


def test_a_pad_id_that_contradicts_the_zero_row_is_warned_about():
    with pytest.warns(PaddingWarning, match="pad_id=1 \\(given\\), but row 3 of both token embeddings is all zeros"):
        config, _ = from_torch_nn_transformer(*wrapper(padding_idx=3), pad_id=1)
    assert config.pad_id == 1  # what the user said, said back to them, not silently replaced


def test_a_negative_pad_id_is_refused_without_placeholder_sizes(tmp_path, capsys):
    path = tmp_path / "model.pt"
    torch.save({k: torch.from_numpy(v) for k, v in tutorial_state().items()}, path)
    status = main(["convert", str(path), str(tmp_path / "o.safetensors"), "--set", "norm_placement=post",
                   "--set", "n_heads=2", "--set", "max_len=16", "--set", "pad_id=-1"])
    err = capsys.readouterr().err
    assert status == 2 and "pad_id: -1 is negative" in err and "vocab_size=2" not in err, err
    status = main(["convert", str(path), str(tmp_path / "o.safetensors"), "--set", "norm_placement=post",
                   "--set", "n_heads=2", "--set", "max_len=16", "--set", "pad_id=44"])
    err = capsys.readouterr().err
    assert status == 2 and "src_vocab_size=40, tgt_vocab_size=45" in err, err


def test_convert_warns_on_stderr_when_the_weights_contradict_the_pad_id(tmp_path, capsys):
    path = tmp_path / "model.pt"
    torch.save({k: torch.from_numpy(v) for k, v in tutorial_state(padding_idx=3).items()}, path)
    status = main(["convert", str(path), str(tmp_path / "o.safetensors"), "--set", "norm_placement=post",
                   "--set", "n_heads=2", "--set", "max_len=16", "--set", "pad_id=1"])
    out, err = capsys.readouterr()
    assert status == 0
    assert "rosetta convert: warning: pad_id=1 (given), but row 3" in err and "WARNING" not in out


def test_convert_runs_a_trial_forward_pass_and_warns_on_non_finite_logits(tmp_path, capsys):
    state = tutorial_state()
    path = tmp_path / "model.pt"
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, path)
    argv = ["convert", str(path), str(tmp_path / "ok.safetensors"), "--set", "norm_placement=post", "--set", "n_heads=2",
            "--set", "max_len=16", "--set", "pad_id=0"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "trial forward pass (NumPy, 3 padded rows): every logit finite" in out
    # the one warning: a bare state dict names no system to run it in (every "not verified" is said twice)
    assert [line for line in err.splitlines() if "warning:" in line and "not verified:" not in line] == [], err
    # Finite float32 weights whose products overflow float32: every logit is infinite or NaN.
    # The decoder's final LayerNorm is shifted to give positive outputs (each >= 5 - sqrt(7)), so
    # every term of y @ W is >= 2.3e38 and each sum passes float32's 3.4e38 in any order. Unshifted,
    # a row's outputs sum to ~0 and its partial sums to at most 2.7 here: whether y @ W overflowed
    # depended on the order OpenBLAS's kernel for the CPU adds them in (Haswell's and Zen's did; the
    # AVX-512 SkylakeX kernel picked on AVX-512 CPUs kept every logit finite: OPENBLAS_CORETYPE).
    state["generator.weight"] = np.full_like(state["generator.weight"], 1e38)
    state["transformer.decoder.norm.bias"] = np.full_like(state["transformer.decoder.norm.bias"], 5.0)
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, path)
    argv[2] = str(tmp_path / "huge.safetensors")
    assert main(argv) == 0  # the file is what was asked for; the warning says what it will do
    out, err = capsys.readouterr()
    assert "rosetta convert: warning: a trial forward pass on 3 padded rows (pad_id=0) gave" in err, err
    assert "NaN or infinite" in err and "every logit finite" not in out


def test_generate_says_which_form_of_src_it_read(capsys):
    assert main(["generate", "--src", "3,1,4"]) == 0
    out, err = capsys.readouterr()
    assert "--src '3,1,4' read as token ids (0 <bos> 1)" in err and '--src "3 1 4"' in err
    assert main(["generate", "--src", "3 1 4"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "4 1 3" and "read as digits (token ids 6,4,7)" in err


def test_generate_stops_each_row_at_its_eos(tmp_path, capsys):
    config = ModelConfig(src_vocab_size=40, tgt_vocab_size=45, d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1,
                         n_decoder_layers=1, max_len=8)
    params = init_params(config, seed=3, dtype=np.float32)
    checkpoint.save(tmp_path / "m.safetensors", config, params)
    src = np.array([[5, 6, 7, 8], [9, 10, 11, 12]])
    full = np.asarray(impl_numpy.Model(config, params, dtype="float32").generate(src, max_len=8, bos_id=1, eos_id=44))
    # Choose as EOS a token one row writes in the middle, so the other positions would print padding.
    eos = int(full[0][2])
    ended = np.asarray(impl_numpy.Model(config, params, dtype="float32").generate(src, max_len=8, bos_id=1, eos_id=eos))
    assert main(["generate", str(tmp_path / "m.safetensors"), "--src", "5,6,7,8;9,10,11,12", "--bos", "1",
                 "--eos", str(eos), "--max-len", "8"]) == 0
    rows = capsys.readouterr().out.strip("\n").split("\n")
    for printed, row in zip(rows, ended):
        stop = np.flatnonzero(row == eos)
        expected = row[: stop[0]] if stop.size else row
        assert printed.split() == [str(int(i)) for i in expected]
    assert len(rows[0].split()) <= 2
