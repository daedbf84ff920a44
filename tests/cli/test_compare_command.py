"""`rosetta compare` on a user's own torch model (a factory in the user's file, its weights beside
it), the command-line side of tests/check/test_foreign_compare.py (issue 45):

- a model that cannot run is an error (exit 2) with the user's own frames, not a divergence, and
  the report is still printed and written;
- a divergence found with `--grads` is a divergence (exit 1), not "your model could not run";
- the switches named at a divergence are those acting for this config, including the sizes that
  can explain it (n_heads) and, for a model read along the wrong axes, the layout's `batch_axis`;
- every missing required `--set` is named in one run;
- `rosetta compare` shows the status line the other long commands have, on a terminal.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the systems here are torch.nn models")

from systems import randomize_, torch_tutorial  # noqa: E402

SIZES = dict(src_vocab=23, tgt_vocab=19, d_model=32, n_heads=4, d_ff=48, n_layers=2, max_len=40)
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nn.Transformer's nested-tensor notes
        yield


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



def test_a_model_that_cannot_run_still_prints_and_writes_its_report(user, capsys, tmp_path):
    code, out, err = rosetta(capsys, "compare", f"{user / 'tut.py'}:build", str(user / "tut.pt"), *TUTORIAL, *TOLD,
                             "--run", "run_broken", "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"))
    assert code == 2, out + err
    assert "your model could not run: AttributeError" in err and "result: ERROR" in out, out + err
    import json

    data = json.loads((tmp_path / "r.json").read_text())
    assert data["your_model_error"].startswith("AttributeError") and "in run_broken" in data["your_traceback"], data
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"



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
