"""benchmarks/gpu_half_precision.py, the one-call measurement of the GPU tolerance rows, works:
without a GPU it refuses with the reason (exit 2), and its measuring path runs and tabulates on
the CPU's rows, so the next session with a GPU can trust it to run."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_half_precision.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("gpu_half_precision", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_says_so(script, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the script measures instead")
    assert script.main(["--backends", "numpy,torch"]) == 2
    assert "no GPU here" in capsys.readouterr().err


def test_it_measures_and_tabulates_on_the_cpu(script, capsys, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.delenv("ROSETTA_DEVICES", raising=False)
    code = script.main(["--backends", "numpy,torch", "--devices", "cpu", "--dtypes", "float32",
                        "--examples", "3", "--long-examples", "0"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| torch/cpu/float32 |" in out and "margin" in out
    assert "ROSETTA_DEVICES" not in __import__("os").environ, "the script left its device selection behind"
