"""`conformance.compare` of a user's own torch model beside the oracle (conformance/check/foreign,
issue 45); `rosetta compare`'s command line is tests/cli/test_compare_command.py.

- every built-in layout's `[taps]` read the right tensor under every norm placement its system
  allows: each torch system's clean model, under each placement, is `ok` (nn.Transformer's
  norm_first=True was compared at norm1/norm2, right only for post-LN);
- the report says what the conversion assumed (the layout's defaults) and what a live model's
  `model.config` gave;
- a backward pass that raises is kept apart from a model that cannot run, and the user's own
  frames are shown, under a system Python too;
- every missing required setting is on the error, and named in its message.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the systems here are torch.nn models")

import conformance  # noqa: E402
from conformance.convert import builtin_layouts, load_layout  # noqa: E402
from systems import (algoperf_torch, annotated, from_scratch, hyunwoongko, llmhub, pre_ln_tutorial,  # noqa: E402
                     randomize_, sublayer_norm, torch_tutorial)

SIZES = dict(src_vocab=23, tgt_vocab=19, d_model=32, n_heads=4, d_ff=48, n_layers=2, max_len=40)
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nn.Transformer's nested-tensor notes
        yield


def padded(pad: int, src_vocab: int, tgt_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Three rows of (B, L) ids, full and short, padded with `pad`: every mask matters."""
    rng = np.random.default_rng(0)

    def rows(vocab, lengths, width):
        real = np.array([i for i in range(vocab) if i != pad])
        out = np.full((len(lengths), width), pad, dtype=np.int64)
        for r, n in enumerate(lengths):
            out[r, :n] = rng.choice(real, n)
        return out

    return rows(src_vocab, [9, 5, 2], 9), rows(tgt_vocab, [7, 4, 1], 7)


def _algoperf(variant: str):
    return randomize_(algoperf_torch.make(variant, ntoken=29, d_model=32, nhead=4, d_hid=48, nlayers=2, max_len=16), 1)


# layout -> {norm_placement: (make the clean model, overrides, run, pad id, (src vocab, tgt vocab))}
CLEAN = {
    "from-scratch": {"post": (lambda: from_scratch.make(**SIZES), {}, None, from_scratch.PAD)},
    "llmhub": {"post": (lambda: llmhub.make(**SIZES), {}, None, llmhub.PAD)},
    "hyunwoongko": {"post": (lambda: hyunwoongko.make(**SIZES), {"max_len": 40}, None, hyunwoongko.PAD)},
    "sublayer-norm": {"post": (lambda: sublayer_norm.make(**SIZES), {}, None, sublayer_norm.PAD)},
    "pre-ln-tutorial": {"pre": (lambda: pre_ln_tutorial.make(**SIZES), {}, None, pre_ln_tutorial.PAD)},
    "annotated-transformer": {"pre": (lambda: annotated.make(**SIZES), {"pad_id": annotated.PAD}, annotated.logits,
                                      annotated.PAD)},
    "torch-nn-transformer": {
        placement: (lambda first=(placement == "pre"): torch_tutorial.make(**SIZES, norm_first=first),
                    {"norm_placement": placement, "pad_id": torch_tutorial.PAD}, torch_tutorial.logits,
                    torch_tutorial.PAD)
        for placement in ("post", "pre")},
    "algoperf-wmt-torch": {"pre": (lambda: _algoperf("base"), {}, None, 0),
                           "post": (lambda: _algoperf("post-ln"), {}, None, 0)},
}
VOCABS = {"algoperf-wmt-torch": (29, 29)}
# The layouts whose clean models run elsewhere, under every placement they allow: the Flax
# systems (each linen run costs JAX dispatches) and transformers' families. Each is a pytest node
# id under tests/, and `test_every_layout_run_elsewhere_is_collected_there` holds them to it.
ELSEWHERE = {
    "flax-wmt": ("check/test_side_by_side.py::test_flax_wmt_clean_agrees_everywhere",),
    "algoperf-wmt-flax": tuple(f"check/test_side_by_side_algoperf.py::test_clean_flax_agrees_in_every_variant[{variant}]"
                               for variant in ("base", "post-ln")),  # pre-LN, post-LN
    **{layout: (f"convert/test_hf_families.py::test_taps_read_transformers_tensors_where_ours_computes_them[{family}]",)
       for layout, family in (("hf-bart", "bart"), ("hf-m2m100", "m2m_100"), ("hf-marian", "marian"),
                              ("hf-mbart", "mbart"), ("hf-pegasus", "pegasus"))},
    "hf-t5": tuple(f"convert/test_hf_t5.py::test_taps_read_transformers_tensors_where_ours_computes_them[{family}]"
                   for family in ("t5", "t5-v1_1")),
    "hf-mt5": ("convert/test_hf_t5.py::test_taps_read_transformers_tensors_where_ours_computes_them[mt5]",),
    "hf-umt5": ("convert/test_hf_t5.py::test_taps_read_transformers_tensors_where_ours_computes_them[umt5]",),
    **{layout: (f"convert/test_hf_families.py::test_taps_read_transformers_tensors_where_ours_computes_them[{family}]",)
       for layout, family in (("hf-plbart", "plbart"), ("hf-blenderbot", "blenderbot"),
                              ("hf-blenderbot-small", "blenderbot_small"))},
    "hf-fsmt": ("convert/test_hf_fsmt.py::test_taps_read_transformers_tensors_where_ours_computes_them",),
    # Run clean against the system itself where it is installed (the fixture scripts call
    # conformance.compare there, every tap in float32 and float64); the tests read their records.
    "opennmt-py": ("convert/test_opennmt_py.py::test_the_fixture_script_checked_the_taps_and_the_island_against_opennmt_py",),
    "fairseq-transformer": ("convert/test_fairseq.py::test_the_fixture_script_checked_the_taps_and_the_island_against_fairseq",),
    "hf-whisper": ("convert/test_hf_whisper.py::test_compare_reads_a_live_whisper_with_its_config",),
    "openai-whisper": ("convert/test_openai_whisper.py::test_compare_reads_a_live_whisper_with_its_dims",),
}


def parametrized_ids(function) -> list[str]:
    """The ids pytest gives `function`'s cases: one per combination of its parametrize marks
    (the mark nearest the function first, as pytest joins them)."""
    ids = [""]
    for mark in getattr(function, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        cases = []
        for value in mark.args[1]:
            values = value.values if hasattr(value, "values") and hasattr(value, "marks") else (
                value if isinstance(value, tuple) else (value,))
            cases.append(getattr(value, "id", None) or "-".join(str(v) for v in values))
        ids = [f"{before}-{case}" if before else case for before in ids for case in cases]
    return ids


def collected(node: str) -> bool:
    """Whether `room/file.py::function[id]` under tests/ is a test pytest collects: the file is
    there, the function is in the module, and its parametrization (if any) gives that id."""
    import importlib

    path, _, rest = node.partition("::")
    name, _, case = rest.partition("[")
    if not (TESTS / path).is_file():
        return False
    function = getattr(importlib.import_module(Path(path).stem), name, None)
    if not callable(function):
        return False
    return case.rstrip("]") in parametrized_ids(function)  # "" for an unparametrized test


def allowed_placements(layout) -> set[str]:
    """The norm placements a layout's system allows: the preset's, both when the user must (or
    may) say it, and what its `[[infer]]` rules read from the keys."""
    placements = {layout.base_switches()["norm_placement"]}
    if "norm_placement" in layout.free | layout.required:
        placements |= {"pre", "post"}
    for rule in layout.infer:
        for switches in (rule.present, rule.absent):
            if "norm_placement" in switches:
                placements.add(switches["norm_placement"])
    return placements


def test_every_builtin_layout_is_run_clean_under_each_placement_it_allows():
    names = {layout.name for layout in builtin_layouts()}
    assert names == set(CLEAN) | set(ELSEWHERE), names ^ (set(CLEAN) | set(ELSEWHERE))
    for name in CLEAN:
        assert allowed_placements(load_layout(name)) == set(CLEAN[name]), name


def test_every_layout_run_elsewhere_is_collected_there():
    """ELSEWHERE names real tests: each node id is one pytest collects (hf-mt5 was said to be
    covered by test_hf_t5's taps test, parametrized over t5 and t5-v1_1 only)."""
    pytest.importorskip("transformers", reason="the families' tests need transformers")
    pytest.importorskip("flax", reason="the Flax systems' tests need flax")
    missing = [node for nodes in ELSEWHERE.values() for node in nodes if not collected(node)]
    assert not missing, missing
    assert not collected("convert/test_hf_t5.py::test_taps_read_transformers_tensors_where_ours_computes_them[t6]")


@pytest.mark.parametrize("name, placement", [(n, p) for n, by in CLEAN.items() for p in by])
def test_a_clean_model_is_ok_under_each_norm_placement(name, placement):
    make, overrides, run, pad = CLEAN[name][placement]
    src, tgt = padded(pad, *VOCABS.get(name, (SIZES["src_vocab"], SIZES["tgt_vocab"])))
    model = randomize_(make(), 1)
    if name == "algoperf-wmt-torch":  # the decoder embeds the shifted targets itself
        report = conformance.compare(model, name, src, tgt, n_heads=4, backends=(), **overrides)
    else:
        report = conformance.compare(model, name, src, tgt, run=run, n_heads=4, backends=(), **overrides)
    assert report.config.norm_placement == placement
    assert report.ok and report.first_divergence is None, str(report)
    compared = {t for t in report.tensors if report.cells[(t, report.yours.label)].comparison is not None}
    # Each sublayer's residual output is read where this placement computes it, never skipped.
    assert {"encoder.0.self_attn", "encoder.1.ffn", "decoder.1.self_attn", "decoder.1.cross_attn", "decoder.1.ffn",
            "logits"} <= compared, str(report)


def test_the_issue_pre_ln_tutorial_model_agrees_and_norm1_is_not_read():
    """The issue's model: the tutorial's Seq2SeqTransformer with norm_first=True, float64, so that a
    wrong tap (norm1's output) could not hide under float32's tolerance."""
    model = randomize_(torch_tutorial.make(**SIZES, norm_first=True), 1).double()
    src, tgt = padded(torch_tutorial.PAD, SIZES["src_vocab"], SIZES["tgt_vocab"])
    report = conformance.compare(model, "torch-nn-transformer", src, tgt, run=torch_tutorial.logits, n_heads=4,
                                 norm_placement="pre", pad_id=torch_tutorial.PAD, backends=())
    assert report.ok, str(report)
    cell = report.cells[("decoder.0.cross_attn", "yours/cpu/float64")]
    assert cell.comparison.max_abs < 1e-12, str(report)


# -- what the conversion assumed, and what model.config gave ---------------------------------------------


def test_the_report_names_the_defaults_the_conversion_assumed():
    model = randomize_(torch_tutorial.make(**SIZES), 1)
    src, tgt = padded(torch_tutorial.PAD, SIZES["src_vocab"], SIZES["tgt_vocab"])
    report = conformance.compare(model, "torch-nn-transformer", src, tgt, run=torch_tutorial.logits, n_heads=4,
                                 norm_placement="post", pad_id=torch_tutorial.PAD, backends=())
    text = str(report)
    assert "activation=relu (the layout's default" in text and "layer_norm_eps=1e-05 (the layout's default" in text, text
    assert any(line.startswith("activation=relu") for line in report.to_json()["assumed"])


def test_a_live_marian_is_compared_by_its_config_and_the_report_says_so():
    """The issue's call: `conformance.compare(marian, "hf-marian", ...)` with no n_heads, on a
    Marian whose activation_function is gelu (the layout's preset says silu)."""
    transformers = pytest.importorskip("transformers", reason="a transformers MarianMTModel")
    config = transformers.MarianConfig(
        vocab_size=19, decoder_vocab_size=19, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=40, pad_token_id=18,
        decoder_start_token_id=18, eos_token_id=0, forced_eos_token_id=0, activation_function="gelu",
        scale_embedding=True)
    torch.manual_seed(0)
    marian = randomize_(transformers.MarianMTModel(config).eval(), 3, buffers=("final_logits_bias",),
                        skip=("embed_positions",))
    src, tgt = padded(18, 19, 19)

    def run(model, src, tgt):
        return model(input_ids=src, attention_mask=(src != 18).long(), decoder_input_ids=tgt).logits

    report = conformance.compare(marian, "hf-marian", src, tgt, run=run, backends=())
    assert report.ok and report.config.activation == "gelu" and report.config.n_heads == 4, str(report)
    text = str(report)
    assert "read from MarianMTModel.config:" in text and "activation=gelu" in text and "n_heads=4" in text, text
    assert report.to_json()["read_from_model_config"]["activation"] == "gelu"


def test_every_tap_at_a_layer_norm_says_the_placement_it_reads():
    """A sublayer's output at a norm's output is post-LN's, at a norm's input pre-LN's: each such
    tap of every built-in layout carries `when = { norm_placement = ... }` saying which."""
    for layout in builtin_layouts():
        for tap in layout.taps:
            last = tap.module.rsplit(".", 2)[-2:] if tap.module.rsplit(".", 1)[-1].isdigit() else tap.module.rsplit(".", 1)[-1:]
            if tap.tensor.endswith(("self_attn", "cross_attn", "ffn")) and "norm" in ".".join(last).lower():
                expected = "pre" if tap.input is not None else "post"
                assert tap.when.get("norm_placement") == expected, (layout.name, tap.describe())


def test_a_placement_against_the_systems_own_is_not_read_at_its_norms():
    """from-scratch (post-LN) converted with norm_placement="pre": its norms' outputs are not what
    a pre-LN model computes there, so they are not exposed, and the reason names the placement."""
    model = randomize_(from_scratch.make(**SIZES), 1)
    src, tgt = padded(from_scratch.PAD, SIZES["src_vocab"], SIZES["tgt_vocab"])
    report = conformance.compare(model, "from-scratch", src, tgt, n_heads=4, norm_placement="pre", backends=())
    why = report.unexposed()["encoder.0.self_attn"]
    assert "only when norm_placement = 'post'" in why and "this model: norm_placement = 'pre'" in why, why
    assert not report.ok and report.first_divergence == "encoder.output", str(report)
    assert "norm_placement = 'pre'" in str(report).split("first divergence:")[1]


# -- the user's code, the missing settings, taps at the residual stream (issue 45: 1, 3, 11-13, 17) --


def test_a_backward_pass_that_raises_is_kept_apart_from_could_not_run():
    """The user's own code failing only in its backward pass: the forward comparison stands, the
    failure is `backward_error` with its frames, and `could_not_run` stays False."""
    model = randomize_(from_scratch.make(**SIZES), 1)
    src, tgt = padded(from_scratch.PAD, SIZES["src_vocab"], SIZES["tgt_vocab"])
    labels = np.where(tgt == from_scratch.PAD, from_scratch.PAD, np.roll(tgt, -1, axis=1))

    def run_without_grads(model, src, tgt):
        if torch.is_grad_enabled():
            raise RuntimeError("this model has no backward pass")
        return model(src, tgt)

    report = conformance.compare(model, "from-scratch", src, tgt, run=run_without_grads, n_heads=4, backends=(),
                                 grads=True, labels=labels)
    assert not report.could_not_run and report.first_divergence is None and not report.ok, str(report)
    assert report.backward_error == "RuntimeError: this model has no backward pass", report.backward_error
    assert "in run_without_grads" in report.backward_traceback, report.backward_traceback
    text = str(report)
    assert "your model could not run" not in text and "backward pass failed" in text, text
    assert report.to_json()["your_model_error"] is None


def test_every_missing_field_is_on_the_error_and_its_message_names_them_all():
    from conformance.convert import convert_arrays
    from conformance.core.errors import ConfigError

    state = {k: v.numpy() for k, v in randomize_(torch_tutorial.make(**SIZES), 1).state_dict().items()}
    with pytest.raises(ConfigError) as caught:
        convert_arrays(state, "torch-nn-transformer")
    error = caught.value
    assert error.fields == ("n_heads", "norm_placement", "pad_id") and error.field == "n_heads", error.fields
    first = str(error).splitlines()[0]
    assert "ModelConfig.n_heads" not in first and "n_heads, norm_placement, pad_id" in first, first
    assert "--set n_heads=N --set norm_placement=post|pre --set pad_id=N" in str(error), str(error)
    with pytest.raises(ConfigError) as one:
        convert_arrays(state, "torch-nn-transformer", n_heads=4, norm_placement="post")
    assert one.value.fields == ("pad_id",) and str(one.value).startswith("ModelConfig.pad_id:")


def test_a_system_python_does_not_hide_user_code_under_its_prefix(monkeypatch):
    """With a system Python (sys.prefix = /usr) a user's /usr/src/app is the user's code: its
    frame is shown, not only the innermost one (the standard library's, here)."""
    from conformance.check.foreign.user_code import user_traceback

    namespace: dict = {}
    exec(compile("import json\ndef forward(x):\n    return json.loads(x)\n", "/usr/src/app/model.py", "exec"),
         namespace)
    try:
        namespace["forward"]("{")
    except ValueError as exc:
        caught = exc
    monkeypatch.setattr(sys, "prefix", "/usr")
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    frames = user_traceback(caught)
    assert 'File "/usr/src/app/model.py", line 3, in forward' in frames, frames
    files = [line for line in frames.splitlines() if line.lstrip().startswith('File "')]
    assert "json" in files[-1] and not any("json" in line for line in files[:-1]), frames  # the innermost, once


def test_a_module_returning_the_residual_stream_is_read_under_either_placement():
    """The annotated transformer's SublayerConnection returns x + sublayer(norm(x)), sublayer-norm's
    modules norm(x + sublayer(x)): the residual stream after the sublayer, the canonical tensor
    under either placement. Converted with the other placement, the model diverges where it
    differs and the report names norm_placement there (a `when` would hide it)."""
    src, tgt = padded(sublayer_norm.PAD, SIZES["src_vocab"], SIZES["tgt_vocab"])
    model = randomize_(sublayer_norm.make(**SIZES), 1).double()
    report = conformance.compare(model, "sublayer-norm", src, tgt, n_heads=4, norm_placement="pre", backends=())
    assert report.first_divergence == "encoder.0.self_attn", str(report)
    assert "norm_placement = 'pre'" in str(report).split("first divergence:")[1], str(report)
    src, tgt = padded(annotated.PAD, SIZES["src_vocab"], SIZES["tgt_vocab"])
    model = randomize_(annotated.make(**SIZES), 1).double()
    report = conformance.compare(model, "annotated-transformer", src, tgt, run=annotated.logits, n_heads=4,
                                 norm_placement="post", pad_id=annotated.PAD, backends=())
    assert report.first_divergence == "encoder.0.self" and not report.unexposed().get("encoder.0.self_attn"), str(report)


def test_the_docs_say_which_taps_carry_a_placement():
    """docs/check.md claimed `when` in every built-in layout; the taps at modules that return the
    residual stream (annotated-transformer, sublayer-norm) rightly have none."""
    text = (TESTS.parent / "docs" / "check.md").read_text()
    bullet = text[text.index("- **Taps by norm placement**"):].split("\n- ")[0]
    assert "in every built-in layout" not in bullet, bullet
    assert "SublayerConnection" in bullet and "sublayer-norm" in bullet and "has no `when`" in " ".join(bullet.split())


def test_user_code_reporting_is_a_module_of_its_own():
    import conformance.check.foreign.side_by_side as side_by_side
    from conformance.check.foreign import user_code

    assert callable(user_code.user_traceback)
    lines = Path(side_by_side.__file__).read_text().count("\n")
    assert lines <= 400, f"side_by_side.py has {lines} lines"
