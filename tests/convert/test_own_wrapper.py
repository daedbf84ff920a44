"""A user's own wrapper around nn.Transformer, ported in a few lines (issue 16): the tutorial's
model with three of its modules renamed, converted three short ways, each checked against the
PyTorch model itself on padded inputs.

- a layout file of four lines: `extends = "torch-nn-transformer"` plus the renamed keys;
- `rosetta convert --rename OLD.=NEW.` (no layout file at all);
- `rename_prefixes(state_dict, {...})` in Python.

Also: position buffers are accepted as (max_len, D), (1, max_len, D) and (max_len, 1, D), and
`rosetta inspect` lists every missing and unexpected key.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the wrapper is a PyTorch model")

from conformance.cli import main  # noqa: E402
from conformance.convert import LayoutError, import_state_dict, load_layout, rename_prefixes  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from systems import randomize_, torch_tutorial  # noqa: E402
from systems.harness import assert_matches_source, padded_batch, run_backend  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # nn.Transformer's nested-tensor notes

SIZES = dict(src_vocab=23, tgt_vocab=19, d_model=16, n_heads=2, d_ff=24, n_layers=2, max_len=12)
# The user's wrapper calls its modules emb_src, emb_tgt, head and pos where the tutorial says
# src_tok_emb.embedding, tgt_tok_emb.embedding, generator and positional_encoding.pos_embedding.
RENAMES = {"src_tok_emb.embedding.": "emb_src.", "tgt_tok_emb.embedding.": "emb_tgt.", "generator.": "head.",
           "positional_encoding.pos_embedding": "pos"}
BACK = {new: old for old, new in RENAMES.items()}
TOLD = dict(n_heads=SIZES["n_heads"], norm_placement="post", pad_id=torch_tutorial.PAD)
LAYOUT = '''extends = "torch-nn-transformer"
[keys]
"emb_src.weight" = "encoder.embedding.weight"
"emb_tgt.weight" = "decoder.embedding.weight"
"head.{w:weight|bias}" = "output.{w}"
"pos" = { copy = ["encoder.position.table", "decoder.position.table"], squeeze = 1 }
'''


@pytest.fixture(scope="module")
def model():
    return randomize_(torch_tutorial.make(**SIZES), seed=11)


@pytest.fixture(scope="module")
def reference(model):
    src, tgt = padded_batch(torch_tutorial.PAD, SIZES["src_vocab"], SIZES["tgt_vocab"])
    with torch.no_grad():
        return src, tgt, torch_tutorial.logits(model, torch.from_numpy(src), torch.from_numpy(tgt)).numpy()


def wrapper_state(model) -> dict[str, np.ndarray]:
    """The state dict the user's wrapper would save: the tutorial's, three modules renamed."""
    return rename_prefixes({k: v.numpy() for k, v in model.state_dict().items()}, RENAMES)


def test_a_layout_that_extends_a_built_in_one(tmp_path, model, reference):
    (tmp_path / "mine.toml").write_text(LAYOUT)
    layout = load_layout(tmp_path / "mine.toml")
    assert layout.required == load_layout("torch-nn-transformer").required  # inherited, not copied
    config, params = import_state_dict(wrapper_state(model), tmp_path / "mine.toml", **TOLD)
    src, tgt, expected = reference
    assert_matches_source(run_backend("numpy", config, params, src, tgt), expected, "extends torch-nn-transformer")


def test_rename_prefixes_in_python_and_on_the_command_line(tmp_path, model, reference, capsys):
    src, tgt, expected = reference
    config, params = import_state_dict(rename_prefixes(wrapper_state(model), BACK), "torch-nn-transformer", **TOLD)
    assert_matches_source(run_backend("numpy", config, params, src, tgt), expected, "rename_prefixes")
    torch.save({k: torch.from_numpy(v) for k, v in wrapper_state(model).items()}, tmp_path / "wrapper.pt")
    argv = ["convert", tmp_path / "wrapper.pt", tmp_path / "out.safetensors", "--set", "n_heads=2",
            "--set", "norm_placement=post", "--set", f"pad_id={torch_tutorial.PAD}"]
    for new, old in BACK.items():
        argv += ["--rename", f"{new}={old}"]
    assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
    assert "torch-nn-transformer (auto-detected)" in capsys.readouterr().out
    config, params = checkpoint.load(tmp_path / "out.safetensors")
    assert_matches_source(run_backend("numpy", config, params, src, tgt), expected, "convert --rename")


def test_a_rename_that_matches_nothing_or_collides_is_refused():
    with pytest.raises(KeyError, match="no key starts with 'embed.'"):
        rename_prefixes({"a.weight": 1}, {"embed.": "x."})
    with pytest.raises(KeyError, match="would both be named 'b.weight'"):
        rename_prefixes({"a.weight": 1, "b.weight": 2}, {"a.": "b."})


@pytest.mark.parametrize("shape", ["(max_len, D)", "(1, max_len, D)", "(max_len, 1, D)"])
def test_every_usual_position_buffer_shape_is_accepted(model, reference, shape):
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    table = state["positional_encoding.pos_embedding"][:, 0, :]  # (max_len, D)
    state["positional_encoding.pos_embedding"] = {"(max_len, D)": table, "(1, max_len, D)": table[None],
                                                  "(max_len, 1, D)": table[:, None]}[shape]
    config, params = import_state_dict(state, "torch-nn-transformer", position="table", **TOLD)
    np.testing.assert_array_equal(params["encoder.position.table"], table)
    src, tgt, expected = reference
    assert_matches_source(run_backend("numpy", config, params, src, tgt), expected, f"positions {shape}")


def test_extends_refuses_an_unknown_base_and_a_cycle(tmp_path):
    (tmp_path / "a.toml").write_text('extends = "no-such-layout"\n[keys]\n"x" = "output.weight"\n')
    with pytest.raises(LayoutError, match="extends 'no-such-layout': no built-in layout of that name"):
        load_layout(tmp_path / "a.toml")
    (tmp_path / "b.toml").write_text('extends = "c.toml"\n')
    (tmp_path / "c.toml").write_text('extends = "b.toml"\n')
    with pytest.raises(LayoutError, match="a cycle"):
        load_layout(tmp_path / "b.toml")


def test_inspect_lists_every_missing_and_unexpected_key(tmp_path, model, capsys):
    torch.save({k: torch.from_numpy(v) for k, v in wrapper_state(model).items()}, tmp_path / "wrapper.pt")
    assert main(["inspect", str(tmp_path / "wrapper.pt")]) == 0
    out = capsys.readouterr().out
    # (the position buffer is optional in the layout: a wrapper may compute positions on the fly)
    assert "against the layout torch-nn-transformer: 4 missing, 5 unexpected" in out, out
    for key in ("src_tok_emb.embedding.weight", "tgt_tok_emb.embedding.weight", "generator.weight", "generator.bias"):
        assert f"missing:    {key}\n" in out
    for key in ("emb_src.weight", "head.bias", "pos"):
        assert f"unexpected: {key}\n" in out
    assert "--rename" in out and 'extends = "torch-nn-transformer"' in out
    (tmp_path / "mine.toml").write_text(LAYOUT)
    assert main(["inspect", str(tmp_path / "wrapper.pt"), "--layout", str(tmp_path / "mine.toml")]) == 0
    assert "keys match the layout mine exactly" in capsys.readouterr().out
