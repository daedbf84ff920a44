"""`conformance.compare` and `rosetta compare` after the fourth newcomer walk (issue 45).

- every built-in layout's `[taps]` read the right tensor under every norm placement its system
  allows: each torch system's clean model, under each placement, is `ok` (nn.Transformer's
  norm_first=True was compared at norm1/norm2, right only for post-LN);
- the report says what the conversion assumed (the layout's defaults) and what a live model's
  `model.config` gave;
- a model that cannot run is an error (exit 2) with the user's own frames, not a divergence;
- the switches named at a divergence include the sizes that can explain it (n_heads) and, for a
  model read along the wrong axes, the layout's `batch_axis`;
- every missing required `--set` is named in one run;
- `rosetta compare` shows the status line the other long commands have, on a terminal.
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
TESTS = Path(__file__).resolve().parent


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
# systems (each linen run costs JAX dispatches) and transformers' families.
ELSEWHERE = {
    "flax-wmt": "tests/test_side_by_side.py::test_flax_wmt_clean_agrees_everywhere",
    "algoperf-wmt-flax": "tests/test_side_by_side_algoperf.py::test_clean_flax_agrees_in_every_variant (base: pre, post-ln: post)",
    **{name: "tests/test_hf_families.py::test_taps_read_transformers_tensors_where_ours_computes_them"
       for name in ("hf-bart", "hf-m2m100", "hf-marian", "hf-mbart", "hf-pegasus")},
    **{name: "tests/test_hf_t5.py (taps)" for name in ("hf-t5", "hf-mt5")},
}


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


# -- rosetta compare ----------------------------------------------------------------------------------------

USER = '''
import sys
sys.path.insert(0, {tests!r})
from systems import torch_tutorial

SIZES = dict(src_vocab=23, tgt_vocab=19, d_model=32, n_heads=4, d_ff=48, n_layers=2, max_len=40)


def build():
    return torch_tutorial.make(**SIZES)


def build_batch_first():
    return torch_tutorial.make(**SIZES, batch_first=True)


def build_broken():
    return open_checkpoint("absent.ckpt")


def open_checkpoint(path):
    raise FileNotFoundError(f"no checkpoint at {{path}}")


def run(model, src, tgt):
    return torch_tutorial.logits(model, src, tgt)


def run_broken(model, src, tgt):
    return model.forward_translation(src, tgt)
'''


@pytest.fixture
def user(tmp_path):
    """A user file of the tutorial's model, and its weights saved beside it."""
    path = tmp_path / "tut.py"
    path.write_text(USER.format(tests=str(TESTS)))
    torch.save(randomize_(torch_tutorial.make(**SIZES), 1).state_dict(), tmp_path / "tut.pt")
    torch.save(randomize_(torch_tutorial.make(**SIZES, batch_first=True), 1).state_dict(), tmp_path / "tut_bf.pt")
    return tmp_path


def rosetta(capsys, *argv: str):
    from conformance.cli import main

    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


TUTORIAL = ["--layout", "torch-nn-transformer", "--backends", "none"]
TOLD = ["--set", "n_heads=4", "--set", "norm_placement=post", "--set", "pad_id=1"]


def test_a_model_that_cannot_run_is_an_error_with_its_own_frames(user, capsys):
    code, out, err = rosetta(capsys, "compare", f"{user / 'tut.py'}:build", str(user / "tut.pt"), *TUTORIAL, *TOLD,
                             "--run", "run_broken")
    assert code == 2, out + err
    assert "your model could not run: AttributeError" in err and "forward_translation" in err, err
    assert f'File "{user / "tut.py"}", line' in err and "in run_broken" in err, err
    assert "conformance" not in err.replace("rosetta compare", ""), err  # the user's frames only
    assert "DIVERGES" not in out, out


def test_a_factory_that_raises_shows_its_frames_and_exits_2(user, capsys):
    code, out, err = rosetta(capsys, "compare", f"{user / 'tut.py'}:build_broken", str(user / "tut.pt"), *TUTORIAL, *TOLD)
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert lines[0].startswith("rosetta compare: error:") and "build_broken() raised FileNotFoundError" in lines[0], err
    assert "in build_broken" in err and "in open_checkpoint" in err and 'raise FileNotFoundError' in err, err
    assert "conformance" not in err.replace("rosetta compare", ""), err


def test_a_wrong_head_count_names_n_heads_where_it_diverges(user, capsys):
    code, out, err = rosetta(capsys, "compare", f"{user / 'tut.py'}:build", str(user / "tut.pt"), *TUTORIAL,
                             "--set", "n_heads=2", "--set", "norm_placement=post", "--set", "pad_id=1", "--run", "run")
    assert code == 1, out + err
    assert "first divergence: encoder.0.self_attn" in out and "n_heads = 2" in out, out


def test_a_batch_first_model_is_told_the_layouts_batch_axis(user, capsys):
    code, out, err = rosetta(capsys, "compare", f"{user / 'tut.py'}:build_batch_first", str(user / "tut_bf.pt"),
                             *TUTORIAL, *TOLD, "--run", "run")
    assert code == 1, out + err
    first = out[out.index("first divergence: encoder.embeddings"):]
    assert "batch_axis" in first and "batch_axis = 0" in first, out
    assert "scale_embedding" not in first.split("\n")[1], out  # the axes, not a switch, explain a swapped shape


def test_every_missing_required_setting_is_named_in_one_run(user, capsys):
    code, out, err = rosetta(capsys, "compare", f"{user / 'tut.py'}:build", str(user / "tut.pt"), *TUTORIAL,
                             "--run", "run")
    assert code == 2, out + err
    assert all(f"--set {name}=" in err for name in ("n_heads", "norm_placement", "pad_id")), err


def test_rosetta_compare_shows_a_status_line_on_a_terminal(user, monkeypatch, capsys):
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    from conformance.cli import main

    code = main(["compare", f"{user / 'tut.py'}:build", str(user / "tut.pt"), "--layout", "torch-nn-transformer",
                 "--backends", "numpy", *TOLD, "--run", "run"])
    assert code == 0
    shown = terminal.getvalue()
    marks = [shown.index(m) for m in ("rosetta compare: importing", "rosetta compare: oracle (numpy/cpu/float64)",
                                      "rosetta compare: your model")]
    assert marks == sorted(marks) and shown.endswith("\r\x1b[K"), shown
    assert "\r" not in capsys.readouterr().out


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
