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
# systems (each linen run costs JAX dispatches) and transformers' families. Each is a pytest node
# id under tests/, and `test_every_layout_run_elsewhere_is_collected_there` holds them to it.
ELSEWHERE = {
    "flax-wmt": ("test_side_by_side.py::test_flax_wmt_clean_agrees_everywhere",),
    "algoperf-wmt-flax": tuple(f"test_side_by_side_algoperf.py::test_clean_flax_agrees_in_every_variant[{variant}]"
                               for variant in ("base", "post-ln")),  # pre-LN, post-LN
    **{layout: (f"test_hf_families.py::test_taps_read_transformers_tensors_where_ours_computes_them[{family}]",)
       for layout, family in (("hf-bart", "bart"), ("hf-m2m100", "m2m_100"), ("hf-marian", "marian"),
                              ("hf-mbart", "mbart"), ("hf-pegasus", "pegasus"))},
    "hf-t5": tuple(f"test_hf_t5.py::test_taps_read_transformers_tensors_where_ours_computes_them[{family}]"
                   for family in ("t5", "t5-v1_1")),
    "hf-mt5": ("test_hf_t5.py::test_taps_read_transformers_tensors_where_ours_computes_them[mt5]",),
    "hf-umt5": ("test_hf_t5.py::test_taps_read_transformers_tensors_where_ours_computes_them[umt5]",),
    **{layout: (f"test_hf_families.py::test_taps_read_transformers_tensors_where_ours_computes_them[{family}]",)
       for layout, family in (("hf-plbart", "plbart"), ("hf-blenderbot", "blenderbot"),
                              ("hf-blenderbot-small", "blenderbot_small"))},
    "hf-fsmt": ("convert/test_hf_fsmt.py::test_taps_read_transformers_tensors_where_ours_computes_them",),
    # Run clean against the system itself where it is installed (the fixture scripts call
    # conformance.compare there, every tap in float32 and float64); the tests read their records.
    "opennmt-py": ("convert/test_opennmt_py.py::test_the_fixture_script_checked_the_taps_and_the_island_against_opennmt_py",),
    "fairseq-transformer": ("convert/test_fairseq.py::test_the_fixture_script_checked_the_taps_and_the_island_against_fairseq",),
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
    """Whether `file.py::function[id]` under tests/ is a test pytest collects: the function is in
    the module, and its parametrization (if any) gives that id."""
    import importlib

    path, _, rest = node.partition("::")
    name, _, case = rest.partition("[")
    folder = str(Path(__file__).resolve().parent / Path(path).parent)  # a room under tests/ (tests/convert/...)
    if folder not in sys.path:
        sys.path.insert(0, folder)
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
    assert not collected("test_hf_t5.py::test_taps_read_transformers_tensors_where_ours_computes_them[t6]")


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


def run_short(model, src, tgt):
    return torch_tutorial.logits(model, src, tgt)[:, :-1]  # the last position dropped
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


# -- review of the walk's fixes (issue 45: 1, 3, 11, 12, 13, 17) ------------------------------------------


def test_a_divergence_with_grads_is_a_divergence_not_your_model_could_not_run(user, capsys, tmp_path):
    """The review's repro: n_heads=2 diverges at encoder.0.self_attn; a --run whose logits drop the
    last position makes the loss's shapes disagree. That is a divergence at the logits (exit 1,
    the report printed), not an error of the user's code (cross_entropy is called by us)."""
    code, out, err = rosetta(capsys, "compare", f"{user / 'tut.py'}:build", str(user / "tut.pt"), *TUTORIAL,
                             "--set", "n_heads=2", "--set", "norm_placement=post", "--set", "pad_id=1",
                             "--run", "run_short", "--grads", "--json", str(tmp_path / "r.json"))
    assert code == 1, out + err
    assert "first divergence: encoder.0.self_attn" in out and "could not run" not in out + err, out + err
    assert "result: DIVERGES" in out, out
    backward = out[out.index("backward:"):]
    assert "logits: (3, 5, 19) from your model" in backward and "(3, 6) labels" in backward, backward
    import json

    data = json.loads((tmp_path / "r.json").read_text())
    assert data["your_model_error"] is None and data["backward_divergence"] and data["backward_error"] is None, data


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


def test_a_model_that_cannot_run_still_prints_and_writes_its_report(user, capsys, tmp_path):
    code, out, err = rosetta(capsys, "compare", f"{user / 'tut.py'}:build", str(user / "tut.pt"), *TUTORIAL, *TOLD,
                             "--run", "run_broken", "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"))
    assert code == 2, out + err
    assert "your model could not run: AttributeError" in err and "result: ERROR" in out, out + err
    import json

    data = json.loads((tmp_path / "r.json").read_text())
    assert data["your_model_error"].startswith("AttributeError") and "in run_broken" in data["your_traceback"], data
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


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


def test_the_switches_named_at_a_divergence_are_those_acting_for_this_config(user, capsys):
    from conformance.check.switches import switches_at
    from conformance.core.config import ModelConfig

    code, out, err = rosetta(capsys, "compare", f"{user / 'tut.py'}:build", str(user / "tut.pt"), *TUTORIAL,
                             "--set", "n_heads=2", "--set", "norm_placement=post", "--set", "pad_id=1", "--run", "run")
    acting = next(line for line in out.splitlines() if "switches that act there" in line)
    assert "n_heads = 2" in acting and "relative_" not in acting and "d_head" not in acting, acting
    sinusoid, relative = ModelConfig(), ModelConfig(position="relative", d_head=8)
    assert not {"relative_buckets", "d_head"} & set(switches_at("encoder.0.self_attn", sinusoid))
    assert {"relative_buckets", "relative_max_distance", "d_head"} <= set(switches_at("decoder.0.self", relative))
    assert "relative_buckets" not in switches_at("decoder.0.cross_attn", relative)  # cross-attention has no bias


def test_a_system_python_does_not_hide_user_code_under_its_prefix(monkeypatch):
    """With a system Python (sys.prefix = /usr) a user's /usr/src/app is the user's code: its
    frame is shown, not only the innermost one (the standard library's, here)."""
    from conformance.check.user_code import user_traceback

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
    import conformance.check.side_by_side as side_by_side
    from conformance.check import user_code

    assert callable(user_code.user_traceback)
    lines = Path(side_by_side.__file__).read_text().count("\n")
    assert lines <= 400, f"side_by_side.py has {lines} lines"
