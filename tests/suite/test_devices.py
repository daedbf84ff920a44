"""Which devices run: one decision (`backends.device_skip_reason`) for the suite and `rosetta check`.

Every device is filtered by `--devices`/$ROSETTA_DEVICES, the CPU included; a deselected device is
skipped as deselected, and only a selected device that is really absent is skipped as absent. The
accelerator branch is tested on a CPU-only machine by making torch report a CUDA device.
"""

from __future__ import annotations

import pytest

from conformance.check import backends
from conformance.suite.pytest_plugin import all_targets
from conformance.check.report import default_targets

torch = pytest.importorskip("torch")

ABSENT = backends.accelerator_skip_reason("torch")


@pytest.fixture
def cuda_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def skip_reasons(env: str | None, monkeypatch) -> dict[str, str | None]:
    """torch target label -> its skip reason in the suite (None: it runs)."""
    if env is None:
        monkeypatch.delenv("ROSETTA_DEVICES", raising=False)
    else:
        monkeypatch.setenv("ROSETTA_DEVICES", env)
    monkeypatch.setenv("ROSETTA_BACKENDS", "torch")
    reasons = {}
    for param in all_targets(("float32",)):
        skip = [m for m in param.marks if m.name == "skip"]
        reasons[param.values[0].label] = skip[0].kwargs["reason"] if skip else None
    return reasons


def test_selecting_the_accelerator_deselects_the_cpu(cuda_present, monkeypatch):
    assert skip_reasons("cuda", monkeypatch) == {
        "torch/cpu/float32": backends.DESELECTED,
        "torch/cuda/float32": None,
    }


def test_a_present_but_deselected_accelerator_is_not_called_absent(cuda_present, monkeypatch):
    assert skip_reasons("cpu", monkeypatch) == {
        "torch/cpu/float32": None,
        "torch/cuda/float32": backends.DESELECTED,
    }


def test_every_present_device_runs_by_default(cuda_present, monkeypatch):
    assert skip_reasons(None, monkeypatch) == {"torch/cpu/float32": None, "torch/cuda/float32": None}


def test_an_absent_accelerator_is_absent_only_when_selected(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert skip_reasons(None, monkeypatch) == {"torch/cpu/float32": None, "torch/cuda/float32": ABSENT}
    assert skip_reasons("cuda", monkeypatch) == {"torch/cpu/float32": backends.DESELECTED, "torch/cuda/float32": ABSENT}
    assert skip_reasons("cpu", monkeypatch)["torch/cuda/float32"] == backends.DESELECTED


@pytest.mark.parametrize("selection", ["cpu", "cuda", None])
def test_rosetta_check_selects_the_same_devices_as_the_suite(selection, cuda_present, monkeypatch):
    suite = skip_reasons(selection, monkeypatch)
    targets, skipped = default_targets(["torch"], ["float32"])
    assert {t.label for t in targets} == {label for label, reason in suite.items() if reason is None}
    for label, reason in suite.items():
        if reason is not None:
            assert skipped[label.rsplit("/", 1)[0]] == reason
    # --devices on the command line decides the same way as the variable.
    monkeypatch.delenv("ROSETTA_DEVICES", raising=False)
    assert default_targets(["torch"], ["float32"], devices=selection) == (targets, skipped)


def test_an_unknown_device_name_is_refused(monkeypatch):
    monkeypatch.setenv("ROSETTA_DEVICES", "tpu")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        backends.devices("torch")


def test_a_ci_bound_on_one_dtype_does_not_skip_the_next(monkeypatch):
    """Under ci a compiling backend runs a property at its `ci_compiling_dtypes` only: the float32
    skip must not carry over to float64 when float32 is listed first."""
    from hypothesis import settings

    monkeypatch.setattr(settings, "_current_profile", "ci")
    monkeypatch.setenv("ROSETTA_DEVICES", "cpu")
    monkeypatch.setenv("ROSETTA_BACKENDS", "torch-compiled")
    reasons = {}
    for param in all_targets(("float32", "float64"), ci_compiling_dtypes=("float64",)):
        skip = [m for m in param.marks if m.name == "skip"]
        reasons[param.values[0].label] = skip[0].kwargs["reason"] if skip else None
    assert reasons["torch-compiled/cpu/float64"] is None, reasons
    assert "under ci a compiling backend" in reasons["torch-compiled/cpu/float32"]
