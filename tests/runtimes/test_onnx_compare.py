"""`conformance.compare` on the user's own ONNX files (conformance/check/onnx/compare.py), in ONNX Runtime itself.

Two exports are checked: optimum-onnx's of a tiny random Marian, T5 (v1.0: relative position
bias, RMSNorm, a tied head scaled by d_model^-1/2) and BART (offset positions, embedding LayerNorm)
(the files under tests/fixtures/optimum_{marian,t5,bart}_onnx, made by
tests/fixtures/make_optimum_marian_onnx.py in a throwaway environment: optimum-onnx needs
transformers < 4.58), and rosetta's own (`rosetta convert --to onnx`). A planted bug in either must
be named at the tensor where it first shows.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.xdist_group("onnx")

pytest.importorskip("onnxruntime", reason="the [onnx] extra is not installed: pip install 'rosetta-transformer[onnx]'")
onnx = pytest.importorskip("onnx", reason="the [onnx] extra is not installed")

import conformance  # noqa: E402
from conformance.check.onnx.compare import compare_onnx, is_onnx  # noqa: E402
from conformance.check.report import fixed_batch  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.convert.hf_folder import from_hf_folder  # noqa: E402
from conformance.core.errors import InputError  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FAMILIES = ("marian", "t5", "bart")
OPTIMUM = FIXTURES / "optimum_marian_onnx"
TAPS = FIXTURES / "optimum_marian_onnx_taps.toml"


def optimum(family: str) -> tuple[Path, Path]:
    """(optimum's export of the tiny `family` model, the layout whose taps name its encoder's values)."""
    return FIXTURES / f"optimum_{family}_onnx", FIXTURES / f"optimum_{family}_onnx_taps.toml"


def batch(folder: Path = OPTIMUM):
    config, _ = from_hf_folder(folder)
    return fixed_batch(config)  # 3 rows: no padding, trailing padding, all but one token


@pytest.mark.parametrize("family", FAMILIES)
def test_rosetta_compare_checks_the_optimum_export_tensor_by_tensor(family, capsys):
    folder, taps = optimum(family)
    assert main(["compare", str(folder), "--layout", str(taps), "--backends", "none"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line[:1].isalpha() and len(line.split()) > 1}
    # The layout's taps (node outputs of the encoder graph) and the graphs' own outputs are compared.
    for tensor in ("encoder.embeddings", "encoder.0.self", "encoder.0.self_attn", "encoder.0.ffn", "encoder.1.self",
                   "encoder.1.self_attn", "encoder.output", "logits"):
        assert rows[tensor].rstrip().endswith("ok"), f"{tensor}: {rows[tensor]}\n{out}"
    assert "decoder.0.self" in rows and "not exposed" in rows["decoder.0.self"]
    # hf-marian's own decoder taps name torch modules, no value of the graph.
    assert "names no value of the decoder graph" in out and "result: ok" in out, out


def test_is_onnx_tells_graphs_from_other_models():
    assert is_onnx(OPTIMUM) and is_onnx(str(OPTIMUM / "encoder_model.onnx"))
    assert not is_onnx(FIXTURES) and not is_onnx("my_model.py:build") and not is_onnx(object())


def test_sessions_are_read_from_their_files():
    import onnxruntime

    pair = tuple(onnxruntime.InferenceSession(str(OPTIMUM / name), providers=["CPUExecutionProvider"])
                 for name in ("encoder_model.onnx", "decoder_model_merged.onnx"))
    assert is_onnx(pair)
    src, tgt = batch()
    report = conformance.compare(pair, "hf-marian", src, tgt, weights=OPTIMUM, backends=())  # dispatched to compare_onnx
    assert report.ok and report.cells[("logits", report.yours.label)].comparison.passed, report.to_text()
    with pytest.raises(InputError, match="pass the pair"):
        compare_onnx(pair[0], "hf-marian", src, tgt, weights=OPTIMUM, backends=())


def plant(tmp_path: Path, source: Path, graph: str, change) -> Path:
    """A copy of the optimum folder `source` with `change(proto)` applied to one of its graphs."""
    folder = tmp_path / "planted"
    shutil.copytree(source, folder)
    proto = onnx.load(str(folder / graph))
    change(proto)
    onnx.save(proto, str(folder / graph))
    return folder


def mask_ignored(proto) -> None:
    """The encoder reads an all-ones attention mask instead of its input."""
    graph = proto.graph
    for node in graph.node:
        node.input[:] = ["ones_mask" if name == "attention_mask" else name for name in node.input]
    zero = onnx.helper.make_tensor("zero_i64", onnx.TensorProto.INT64, [], [0])
    one = onnx.helper.make_tensor("one_i64", onnx.TensorProto.INT64, [], [1])
    graph.initializer.extend([zero, one])
    nodes = [onnx.helper.make_node("Mul", ["attention_mask", "zero_i64"], ["zeros_mask"]),
             onnx.helper.make_node("Add", ["zeros_mask", "one_i64"], ["ones_mask"])]
    for node in reversed(nodes):
        graph.node.insert(0, node)


def cache_of_the_next_layer(proto) -> None:
    """The decoder's two layers read each other's self-attention cache: every node of the graph and
    of its If branches that reads layer 0's past keys or values reads layer 1's, and the reverse."""
    swap = {f"past_key_values.{a}.decoder.{part}": f"past_key_values.{b}.decoder.{part}"
            for a, b in ((0, 1), (1, 0)) for part in ("key", "value")}

    def rewire(graph):
        for node in graph.node:
            node.input[:] = [swap.get(name, name) for name in node.input]
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    rewire(attribute.g)

    rewire(proto.graph)


def found_where(tmp_path, family: str, graph: str, change, where: str) -> None:
    """`change` planted in `graph` of the family's optimum export: compare names `where` first."""
    source, taps = optimum(family)
    folder = plant(tmp_path, source, graph, change)
    src, tgt = batch(source)
    report = compare_onnx(folder, str(taps), src, tgt, backends=())
    assert not report.errors, report.errors
    assert report.first_divergence == where, report.to_text()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("graph, change, where", [
    ("encoder_model.onnx", mask_ignored, "encoder.0.self"),
    ("decoder_model_merged.onnx", cache_of_the_next_layer, "logits"),
])
def test_a_planted_bug_in_the_optimum_export_is_found_at_its_tensor(tmp_path, family, graph, change, where):
    found_where(tmp_path, family, graph, change, where)


def edited(name: str, change):
    """A planted bug in one weight of a graph: `change(array)` applied to its initializer `name`."""
    def edit(proto) -> None:
        from onnx import numpy_helper

        tensor = next(t for t in proto.graph.initializer if t.name == name)
        tensor.CopyFrom(numpy_helper.from_array(change(numpy_helper.to_array(tensor).copy()), name))
    edit.__name__ = f"{name} edited"
    return edit


# What each family adds to Marian's equations, each left out of the export in turn: the first
# tensor that reads it is named (the decoder's sit inside the merged graph's If branches: logits).
@pytest.mark.parametrize("family, graph, change, where", [
    ("t5", "encoder_model.onnx", edited("block.0.layer.0.SelfAttention.relative_attention_bias.weight", np.zeros_like),
     "encoder.0.self"),
    ("t5", "decoder_model_merged.onnx",
     edited("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight_merged_0", np.zeros_like), "logits"),
    ("bart", "encoder_model.onnx", edited("embed_positions.weight", lambda table: np.roll(table, -2, axis=0)),
     "encoder.embeddings"),  # positions read from row 0, BART's offset of 2 dropped
    ("bart", "decoder_model_merged.onnx", edited("model.decoder.layernorm_embedding.weight_merged_0", np.ones_like),
     "logits"),
])
def test_a_planted_family_bug_in_the_optimum_export_is_found_at_its_tensor(tmp_path, family, graph, change, where):
    found_where(tmp_path, family, graph, change, where)


def test_bad_input_is_named(tmp_path, capsys):
    assert main(["compare", str(tmp_path), "--backends", "none"]) == 2
    assert "no graphs to compare" in capsys.readouterr().err
    assert main(["compare", "my_model.py:build", "weights.pt"]) == 2
    assert "MODULE:FACTORY needs WEIGHTS and --layout" in capsys.readouterr().err
    assert main(["compare", str(OPTIMUM), "--grads"]) == 2
    assert "--grads: does not apply to ONNX graphs" in capsys.readouterr().err
    src, tgt = batch()
    with pytest.raises(InputError, match="no graphs to compare"):
        compare_onnx(tmp_path, "hf-marian", src, tgt, weights=OPTIMUM, backends=())
    with pytest.raises(InputError, match="one .onnx file is one graph"):
        compare_onnx(OPTIMUM / "encoder_model.onnx", "hf-marian", src, tgt, weights=OPTIMUM, backends=())
    with pytest.raises(InputError, match="no backward pass"):
        compare_onnx(OPTIMUM, "hf-marian", src, tgt, grads=True, backends=())
    bare = tmp_path / "graphs"
    bare.mkdir()
    for name in ("encoder_model.onnx", "decoder_model_merged.onnx"):
        shutil.copy(OPTIMUM / name, bare / name)
    with pytest.raises(InputError, match="the weights the graphs were exported from"):
        compare_onnx(bare, "hf-marian", src, tgt, backends=())


# Our own export: the planted export bugs of tests/breaks.py, found by compare on the files written.
@pytest.fixture(scope="module")
def own_checkpoint(tmp_path_factory):
    from conformance import init_params
    from conformance.core import checkpoint
    from test_onnx import CONFIG

    path = tmp_path_factory.mktemp("own") / "model.safetensors"
    checkpoint.save(path, CONFIG, init_params(CONFIG, seed=3))
    return path


@pytest.mark.parametrize("name", ["source mask input ignored", "decoder reads the cache of the wrong layer"])
def test_a_planted_bug_in_our_export_is_found_by_compare_at_its_tensor(own_checkpoint, tmp_path, name):
    pytest.importorskip("onnxscript", reason="torch's ONNX exporter needs onnxscript (the [onnx] extra)")
    from breaks import ONNX_EXPORT_BREAKS, planted_in_the_export

    folder = tmp_path / "graphs"
    with planted_in_the_export(name):
        assert main(["convert", str(own_checkpoint), str(folder), "--to", "onnx", "--taps", "--no-verify"]) == 0
    from test_onnx import CONFIG

    src, tgt = fixed_batch(CONFIG)
    report = compare_onnx(folder, None, src, tgt, weights=own_checkpoint, backends=())
    assert not report.errors, report.errors
    assert report.first_divergence == ONNX_EXPORT_BREAKS[name][2], report.to_text()
    assert main(["compare", str(folder), str(own_checkpoint), "--backends", "none"]) == 1


def test_our_export_without_taps_is_compared_at_its_logits(own_checkpoint, tmp_path, capsys):
    pytest.importorskip("onnxscript", reason="torch's ONNX exporter needs onnxscript (the [onnx] extra)")
    folder = tmp_path / "graphs"
    assert main(["convert", str(own_checkpoint), str(folder), "--to", "onnx"]) == 0
    capsys.readouterr()
    assert main(["compare", str(folder), str(own_checkpoint), "--backends", "none"]) == 0
    out = capsys.readouterr().out
    logits = next(line for line in out.splitlines() if line.startswith("logits"))
    assert logits.rstrip().endswith("ok") and "not exposed" in out, out
    assert np.isfinite(float(logits.split()[1]))


def layout_file(tmp_path: Path, lines: str) -> Path:
    """A layout in `tmp_path` on top of the Marian taps file: `lines` added to its [taps]."""
    path = tmp_path / "layout.toml"
    path.write_text(f'extends = "{TAPS.resolve()}"\nname = "edited"\n\n[taps]\n{lines}\n')
    return path


def test_a_shift_right_layout_runs_the_graphs_on_the_ids_the_oracle_reads(tmp_path):
    # The graphs take the decoder input as given: fed the unshifted ids while the oracle reads the
    # shifted ones, every decoder tensor would diverge.
    layout = layout_file(tmp_path, 'decoder_input = "shift-right"')
    src, tgt = batch()
    report = compare_onnx(OPTIMUM, str(layout), src, tgt, backends=())
    assert report.ok and report.cells[("logits", report.yours.label)].comparison.passed, report.to_text()


def test_a_tap_inside_an_if_branch_is_told_from_a_misspelled_one(tmp_path):
    layout = layout_file(tmp_path, '"decoder.{i}.self" = { module = "/model/decoder/layers.{i}/self_attn/Softmax_output_0" }\n'
                                   '"decoder.{i}.cross" = { module = "/model/decoder/layers.{i}/encoder_attn/Softmx_output_0" }')
    src, tgt = batch()
    report = compare_onnx(OPTIMUM, str(layout), src, tgt, backends=())
    label = report.yours.label
    inside = report.cells[("decoder.0.self", label)].unavailable
    assert "inside the else_branch of If node 'optimum::if'" in inside and "Softmax_output_0" in inside, inside
    misspelled = report.cells[("decoder.0.cross", label)].unavailable
    assert "names no value of the decoder graph" in misspelled and "Softmx_output_0" in misspelled, misspelled


def without_cache_branch(proto) -> None:
    """The merged decoder with `use_cache_branch` fixed to False: a decoder with no cached branch,
    as optimum's decoder_model.onnx is."""
    graph = proto.graph
    flag = next(i for i in graph.input if i.name == "use_cache_branch")
    graph.input.remove(flag)
    graph.initializer.append(onnx.helper.make_tensor("use_cache_branch", onnx.TensorProto.BOOL, [1], [False]))


def test_a_decoder_without_a_cached_branch_is_reported_as_cache_not_checked(tmp_path):
    folder = plant(tmp_path, OPTIMUM, "decoder_model_merged.onnx", without_cache_branch)
    (folder / "decoder_model_merged.onnx").rename(folder / "decoder_model.onnx")
    src, tgt = batch()
    report = compare_onnx(folder, str(TAPS), src, tgt, backends=())
    assert report.cells[("logits", report.yours.label)].comparison.passed, report.to_text()
    assert "cache not checked" in report.note and "decoder_with_past_model.onnx" in report.note
    assert "cache not checked" in report.to_text()


def test_our_own_bug_is_raised_and_the_graphs_failing_is_reported(tmp_path, monkeypatch):
    from conformance.check.onnx import compare as onnx_compare

    src, tgt = batch()
    # A weight of the wrong shape: ONNX Runtime fails on the graph, which the report names.
    folder = plant(tmp_path, OPTIMUM, "encoder_model.onnx",
                   edited("embed_positions.weight", lambda table: table[:, :-1].copy()))
    report = compare_onnx(folder, str(TAPS), src, tgt, backends=())
    assert report.errors and not report.ok, report.to_text()

    def broken(*args):
        raise KeyError("last_hidden_state")

    monkeypatch.setattr(onnx_compare, "run_optimum", broken)
    with pytest.raises(KeyError, match="last_hidden_state"):
        compare_onnx(OPTIMUM, str(TAPS), src, tgt, backends=())


def test_an_element_type_compare_cannot_read_is_named(tmp_path):
    def int8_logits(proto) -> None:
        next(o for o in proto.graph.output if o.name == "logits").type.tensor_type.elem_type = onnx.TensorProto.INT8

    folder = plant(tmp_path, OPTIMUM, "decoder_model_merged.onnx", int8_logits)
    src, tgt = batch()
    with pytest.raises(InputError, match=r"logits is a tensor\(int8\)"):
        compare_onnx(folder, str(TAPS), src, tgt, backends=())


def test_a_session_made_from_bytes_is_refused():
    import onnxruntime

    pair = tuple(onnxruntime.InferenceSession((OPTIMUM / name).read_bytes(), providers=["CPUExecutionProvider"])
                 for name in ("encoder_model.onnx", "decoder_model_merged.onnx"))
    src, tgt = batch()
    with pytest.raises(InputError, match="made from bytes"):
        compare_onnx(pair, "hf-marian", src, tgt, weights=OPTIMUM, backends=())


def test_the_cli_reads_the_graphs_once(monkeypatch, capsys):
    loaded = []
    load = onnx.load
    monkeypatch.setattr(onnx, "load", lambda path, *args, **kwargs: loaded.append(path) or load(path, *args, **kwargs))
    assert main(["compare", str(OPTIMUM), "--layout", str(TAPS), "--backends", "none"]) == 0
    assert sorted(Path(p).name for p in loaded) == ["decoder_model_merged.onnx", "encoder_model.onnx"], loaded


def test_a_decoder_input_compare_cannot_feed_is_named(tmp_path):
    def extra_input(proto) -> None:
        proto.graph.input.append(onnx.helper.make_tensor_value_info("position_ids", onnx.TensorProto.INT64, ["b", "t"]))

    folder = plant(tmp_path, OPTIMUM, "decoder_model_merged.onnx", extra_input)
    src, tgt = batch()
    report = compare_onnx(folder, str(TAPS), src, tgt, backends=())
    assert "InputError" in report.errors[report.yours.label] and "position_ids" in report.errors[report.yours.label]
