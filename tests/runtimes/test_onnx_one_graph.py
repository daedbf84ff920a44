"""A user's own one-graph ONNX export of a transformers model, run by ONNX Runtime beside the oracle.

    torch.onnx.export(model, (input_ids, attention_mask, decoder_input_ids), "model.onnx")

A tiny random BART (every weight, norm and bias drawn) is exported by both of torch's exporters at
a right-padded batch, with nothing else given: the dynamo exporter (the default) names the inputs
after the forward's arguments and records each node's module in its metadata; the TorchScript
exporter (`dynamo=False`) names its inputs `input.1`, `attention_mask.1`, ... and its nodes by
module scope. `conformance.compare` (and `rosetta compare`) feeds the graph by the layout's
`[hf.call]`, compares the logits, and finds every tensor of the hf-bart `[taps]` in the graph by
those scopes, with no taps file. A planted bug, one initializer of the graph moved, is named at the
first tensor it reaches.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the model is exported by torch.onnx")
transformers = pytest.importorskip("transformers", reason="the model is a transformers model")
onnx = pytest.importorskip("onnx", reason="the export is an ONNX graph")
pytest.importorskip("onnxruntime", reason="the graph runs in ONNX Runtime")
pytest.importorskip("onnxscript", reason="torch.onnx's dynamo exporter writes through onnxscript")

import conformance  # noqa: E402
from conformance.check.onnx import single  # noqa: E402
from conformance.check.onnx.compare import load_graphs  # noqa: E402
from conformance.check.weights import oracle_weights  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.core.errors import InputError  # noqa: E402
from systems import randomize_  # noqa: E402

PAD = 1
SRC = np.array([[5, 6, 7, 8, 9, 2], [10, 11, 12, 2, PAD, PAD], [13, 2, PAD, PAD, PAD, PAD]])
TGT = np.array([[2, 5, 6, 7, 8], [2, 10, 11, PAD, PAD], [2, 13, PAD, PAD, PAD]])
EXPORTERS = {"torchscript": False, "dynamo": True}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(the save_pretrained folder, {exporter: the .onnx file}): one model, both exporters."""
    folder = tmp_path_factory.mktemp("one_graph")
    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=40, d_model=16, encoder_attention_heads=2, decoder_attention_heads=2,
                                     encoder_ffn_dim=32, decoder_ffn_dim=32, encoder_layers=2, decoder_layers=2,
                                     max_position_embeddings=32, pad_token_id=PAD, use_cache=False)
    model = randomize_(transformers.BartForConditionalGeneration(config).eval(), 5, buffers=("final_logits_bias",))
    model.save_pretrained(folder / "bart")
    args = tuple(torch.from_numpy(a) for a in (SRC, (SRC != PAD).astype(np.int64), TGT))
    graphs = {}
    for name, dynamo in EXPORTERS.items():
        graphs[name] = folder / f"{name}.onnx"
        torch.onnx.export(model, args, str(graphs[name]), dynamo=dynamo)
    return folder / "bart", graphs


def planted(path, tmp_path, initializer: str, delta: float):
    """A copy of the graph at `path` with one initializer moved by +-`delta`, the sign alternating
    along its last axis (a uniform shift of a bias before a LayerNorm would be normalized away)."""
    proto = onnx.load(str(path))
    tensor = next(t for t in proto.graph.initializer if t.name == initializer)
    value = onnx.numpy_helper.to_array(tensor)
    moved = value + np.float32(delta) * (-1.0) ** np.arange(value.shape[-1])
    tensor.CopyFrom(onnx.numpy_helper.from_array(moved.astype(np.float32), initializer))
    out = tmp_path / f"planted-{path.name}"
    onnx.save(proto, str(out))
    return out


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_the_export_agrees_tensor_by_tensor_with_no_taps_file(exporter, exported):
    folder, graphs = exported
    report = conformance.compare(str(graphs[exporter]), None, SRC, TGT, weights=str(folder), backends=())
    assert report.ok, report.to_text()
    compared = {t for (t, label), cell in report.cells.items() if label == report.yours.label and cell.comparison}
    assert compared == set(report.tensors), sorted(set(report.tensors) - compared)  # every tensor, the logits too
    assert "one graph, run once on the whole batch" in report.note
    if exporter == "dynamo":
        assert "by name, as the layout's [hf.call] says: input_ids = src_ids" in report.note, report.note
    else:
        assert "in the order of the layout's [hf.call]" in report.note, report.note


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("initializer, first", [("model.encoder.layers.1.fc2.bias", "encoder.1.ffn"),
                                                ("model.decoder.layers.0.encoder_attn.q_proj.bias", "decoder.0.cross")])
def test_a_planted_initializer_is_named_at_its_tensor(exporter, initializer, first, exported, tmp_path):
    folder, graphs = exported
    bad = planted(graphs[exporter], tmp_path, initializer, 0.05)
    report = conformance.compare(str(bad), None, SRC, TGT, weights=str(folder), backends=())
    assert report.first_divergence == first, report.to_text()
    assert report.cells[("logits", report.yours.label)].comparison is not None


def test_rosetta_compare_takes_the_graph_and_its_fixed_shapes(exported, tmp_path, capsys):
    folder, graphs = exported
    assert main(["compare", str(graphs["torchscript"]), str(folder), "--backends", "none"]) == 0
    out = capsys.readouterr().out
    assert "result: ok" in out and "ONNX graphs (one graph)" in out
    bad = planted(graphs["torchscript"], tmp_path, "model.encoder.layers.1.fc2.bias", 0.05)
    assert main(["compare", str(bad), str(folder), "--backends", "none"]) == 1
    assert "first divergence: encoder.1.ffn" in capsys.readouterr().out


def test_inputs_by_a_mapping_and_the_refusals(exported):
    folder, graphs = exported
    names = [i.name for i in onnx.load(str(graphs["torchscript"])).graph.input]
    mapping = dict(zip(names, ("src_ids", "src_mask", "tgt_ids")))
    report = conformance.compare(str(graphs["torchscript"]), None, SRC, TGT, weights=str(folder), backends=(),
                                 inputs=mapping)
    assert report.ok and "as inputs= maps them" in report.note, report.to_text()
    with pytest.raises(InputError, match="values"):
        conformance.compare(str(graphs["torchscript"]), None, SRC, TGT, weights=str(folder), backends=(),
                            inputs={**mapping, names[0]: "input_ids"})
    with pytest.raises(InputError, match=r"exported for fixed shapes \(src_ids \(3, 6\), tgt_ids \(3, 5\)"):
        conformance.compare(str(graphs["dynamo"]), None, SRC[:2], TGT[:2], weights=str(folder), backends=())


def test_the_default_batch_is_padded_at_the_graphs_shapes(exported):
    folder, graphs = exported
    config, _, layout = oracle_weights(str(folder), None, None, {})
    src, tgt = single.default_batch(load_graphs(str(graphs["dynamo"])), config, layout, None)
    assert src.shape == SRC.shape and tgt.shape == TGT.shape
    assert (src[1:] == PAD).any() and not (src[0] == PAD).any()


def test_a_t5_export_is_read_at_its_pre_ln_taps(tmp_path):
    """T5 (pre-LN): a sublayer's output is what the next layer_norm reads (`input = 0` taps). The
    TorchScript exporter only: torch 2.13's dynamo exporter fails on T5's attention reshape."""
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=40, d_model=16, d_kv=8, num_heads=2, d_ff=32, num_layers=2,
                                   relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                   decoder_start_token_id=0, use_cache=False)
    model = randomize_(transformers.T5ForConditionalGeneration(config).eval(), 5)
    model.save_pretrained(tmp_path / "t5")
    src, tgt = np.where(SRC == PAD, 0, SRC), np.where(TGT == PAD, 0, TGT)  # T5's pad id is 0
    tgt[:, 0] = 0
    args = tuple(torch.from_numpy(a) for a in (src, (src != 0).astype(np.int64), tgt))
    torch.onnx.export(model, args, str(tmp_path / "t5.onnx"), dynamo=False)
    report = conformance.compare(str(tmp_path / "t5.onnx"), None, src, tgt, weights=str(tmp_path / "t5"), backends=())
    assert report.ok, report.to_text()
    compared = {t for (t, label), cell in report.cells.items() if label == report.yours.label and cell.comparison}
    assert compared == set(report.tensors), sorted(set(report.tensors) - compared)
    bad = planted(tmp_path / "t5.onnx", tmp_path, "encoder.block.1.layer.0.layer_norm.weight", 0.2)
    report = conformance.compare(str(bad), None, src, tgt, weights=str(tmp_path / "t5"), backends=())
    assert report.first_divergence == "encoder.1.self", report.to_text()


class Called(torch.nn.Module):
    """A user's wrapper that calls the model with some of its keywords, the graph's inputs named
    after them (TorchScript exporter, `input_names`)."""

    def __init__(self, model, keywords: tuple[str, ...]):
        super().__init__()
        self.model, self.keywords = model, keywords

    def forward(self, *args):
        return self.model(**dict(zip(self.keywords, args))).logits


def export_called(folder, keywords: tuple[str, ...], path):
    model = transformers.BartForConditionalGeneration.from_pretrained(str(folder)).eval()
    given = {"input_ids": SRC, "attention_mask": (SRC != PAD).astype(np.int64), "decoder_input_ids": TGT,
             "decoder_attention_mask": (TGT != PAD).astype(np.int64)}
    torch.onnx.export(Called(model, keywords), tuple(torch.from_numpy(given[k]) for k in keywords), str(path),
                      dynamo=False, input_names=list(keywords), output_names=["logits"])
    return path


def test_a_graph_without_the_source_mask_is_told_the_run_gave_no_mask(exported, tmp_path):
    """Fed by name, its padded rows part from the oracle (it masks nothing): the report says the
    run gave it no padding mask, and how to give it one, before any switch; a batch without
    source padding has nothing to say so about."""
    folder, _ = exported
    graph = export_called(folder, ("input_ids", "decoder_input_ids"), tmp_path / "no-mask.onnx")
    report = conformance.compare(str(graph), None, SRC, TGT, weights=str(folder), backends=())
    text = report.to_text()
    assert report.first_divergence == "logits" and report.unmasked, text
    assert "the run gave your model no padding mask" in text and "export the graph with the source mask" in text, text
    assert report.to_json()["run_gave_no_padding_mask"] is True
    full = np.where(SRC == PAD, 3, SRC)  # the graph's fixed shape, no source padding (the targets keep theirs)
    unpadded = conformance.compare(str(graph), None, full, TGT, weights=str(folder), backends=())
    assert not unpadded.unmasked, unpadded.to_text()
    masked = conformance.compare(str(export_called(folder, ("input_ids", "attention_mask", "decoder_input_ids"),
                                                   tmp_path / "masked.onnx")), None, SRC, TGT, weights=str(folder),
                                 backends=())
    assert not masked.unmasked and "no padding mask" not in masked.to_text(), masked.to_text()


def test_a_graph_named_in_part_by_the_call_is_refused_not_fed_by_order(exported, tmp_path):
    """input_ids, decoder_input_ids, decoder_attention_mask: as many as [hf.call]'s keywords, two
    of them its names; fed by order, decoder_input_ids would get the source mask. Refused, naming
    the input that is not a call keyword and inputs=; mapped with inputs=, it runs."""
    folder, _ = exported
    graph = export_called(folder, ("input_ids", "decoder_input_ids", "decoder_attention_mask"),
                          tmp_path / "partial.onnx")
    with pytest.raises(InputError, match=r"\['decoder_attention_mask'\] are not among the layout's \[hf.call\] names"
                                         r".*inputs=") as info:
        conformance.compare(str(graph), None, SRC, TGT, weights=str(folder), backends=())
    assert info.value.argument == "inputs"
    report = conformance.compare(str(graph), None, SRC, TGT, weights=str(folder), backends=(),
                                 inputs={"input_ids": "src_ids", "decoder_input_ids": "tgt_ids",
                                         "decoder_attention_mask": "tgt_mask"})
    assert "as inputs= maps them" in report.note and report.unmasked, report.to_text()
