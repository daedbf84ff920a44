"""Float32 islands in float64 comparisons are named, not called divergences (issue 53).

transformers' T5 computes its LayerNorm variance in float32 in a float64 model, and Marian's
sinusoid table is float32 whatever the model's dtype: `conformance.compare` of such a model in
float64, with no patch to it, finds errors of 1e-8 to 1e-6 * scale where every other port agrees
to 1e-12. The layouts declare those parts (`[float32_islands]`), and the report labels each such
tensor "float32 island in NAME: expected" and reports the port as right. A real fault planted in
the foreign model (one LayerNorm's epsilon, one attention's scaling) is still a divergence, at its
own tensor; and without the declaration the same T5 comparison fails, so the label is what makes
it pass.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the families are PyTorch models")
pytest.importorskip("transformers", reason="the models are built by transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers beside the rooms

import conformance  # noqa: E402
from conformance.convert import load_layout  # noqa: E402
import test_hf_families as families  # noqa: E402
import test_hf_t5 as t5  # noqa: E402


def t5_report(name: str = "t5", layout=None, plant=None):
    model = copy.deepcopy(t5.build(name)).double()
    model.set_attn_implementation("eager")  # attention weights returned, and T5LayerNorm as it is: no patch
    if plant is not None:
        plant(model)
    src, tgt, _ = t5.batch()
    layout = load_layout(t5.FAMILIES[name].layout) if layout is None else layout
    told = layout.hf.read(model.config.to_dict(), "model.config")
    return conformance.compare(model, layout, src, tgt, run=t5.hf_run, dtype="float64", backends=(), **told)


def marian_report(plant=None):
    """Marian in float64 as its folder converts it: the sinusoid recomputed (position
    "sinusoid-split"), while transformers' model reads its float32 table."""
    model = copy.deepcopy(families.build("marian")).double()
    model.config._attn_implementation = "eager"
    if plant is not None:
        plant(model)
    src, tgt, _ = families.batch("marian")
    layout = load_layout("hf-marian")
    told = layout.hf.read(model.config.to_dict(), "model.config")
    return conformance.compare(model, layout, src, tgt, run=families.hf_run("marian"), dtype="float64", backends=(),
                               position="sinusoid-split", **told)


def labelled(report) -> dict[str, str]:
    return report.islands()


@pytest.mark.parametrize("name", ["t5", "mt5", "umt5"])
def test_t5_in_float64_is_right_with_its_layernorm_island_named(name):
    report = t5_report(name)
    assert report.ok and report.first_divergence is None, report.to_text()
    islands = labelled(report)
    # From the first normed input on (the first attention's weights), never before it.
    assert "encoder.embeddings" not in islands and "decoder.embeddings" not in islands
    assert {"encoder.0.self", "encoder.output", "decoder.1.cross", "logits"} <= set(islands), islands
    assert set(islands.values()) == {"T5LayerNorm"}
    text = report.to_text()
    assert "logits: float32 island in T5LayerNorm: expected" in text and "result: ok" in text, text
    assert report.to_json()["float32_islands"]["logits"] == "T5LayerNorm"


def test_marian_in_float64_is_right_with_its_sinusoid_island_named():
    report = marian_report()
    assert report.ok, report.to_text()
    islands = labelled(report)
    assert {"encoder.embeddings", "decoder.embeddings", "logits"} <= set(islands), islands
    assert "float32 island in the sinusoid table: expected" in report.to_text()


def test_without_the_declaration_the_same_t5_comparison_diverges():
    layout = dataclasses.replace(load_layout("hf-t5"), islands=())
    report = t5_report("t5", layout=layout)
    assert not report.ok and report.first_divergence == "encoder.0.self", report.to_text()
    assert not labelled(report)


def test_a_real_fault_beside_the_island_is_still_a_divergence():
    """One layer's T5LayerNorm epsilon changed in the user's model (1e-6 -> 1e-2): the tensors
    before it are islands, it diverges; a Marian attention's scaling off by 1%: the same."""

    def loose_norm(model):
        model.encoder.block[1].layer[0].layer_norm.variance_epsilon = 1e-2

    report = t5_report("t5", plant=loose_norm)
    assert not report.ok and report.first_divergence == "encoder.1.self", report.to_text()
    assert "encoder.0.ffn" in labelled(report)

    def off_scale(model):
        model.model.decoder.layers[1].self_attn.scaling *= 1.01

    report = marian_report(plant=off_scale)
    assert not report.ok and report.first_divergence == "decoder.1.self", report.to_text()
