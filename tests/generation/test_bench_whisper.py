"""benchmarks/bench_whisper.py compares equal computations: transformers' `generate`, CTranslate2's
`Whisper.generate` (on the model `rosetta convert --to ctranslate2` writes of the same weights) and
impl_torch's `generate` give the same greedy ids on every row, each row running every step (the end
of text suppressed), from <|startoftranscript|> <|notimestamps|>. A small config (the benchmark's
--quick: whisper-base's vocabulary and window length, d_model 64, 2 + 2 layers); and the
benchmark itself, each contender in its own process, end to end (thorough: three spawned workers).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from thorough import thorough_only

pytestmark = [pytest.mark.xdist_group("ctranslate2"),
              pytest.mark.filterwarnings("ignore::conformance.core.generation.note.GenerationWarning")]
pytest.importorskip("ctranslate2", reason="the [ctranslate2] extra is not installed")
pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def contenders():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("whisper_contenders", BENCH / "whisper_contenders.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_transformers_ctranslate2_and_impl_torch_give_the_same_ids(contenders, tmp_path):
    from conformance.check.ctranslate2.target import convert
    from conformance.convert import from_hf

    sizes = contenders.QUICK
    model = contenders.whisper(sizes)
    config, params = from_hf(model)
    convert(config, params, tmp_path / "ct2", verify=False)
    feats = contenders.features(sizes, 3)
    ids = {"hf": contenders.hf_decoder(model, feats, NEW_TOKENS)(),
           "ct2": contenders.ct2_decoder(tmp_path / "ct2", feats, NEW_TOKENS, 1)(),
           "torch": contenders.torch_decoder(config, params, feats, NEW_TOKENS)()}
    for name, got in ids.items():
        assert got.shape == (3, NEW_TOKENS) and not (got == contenders.EOT).any(), f"{name}: {got}"
    assert (ids["ct2"] == ids["hf"]).all() and (ids["torch"] == ids["hf"]).all(), ids
    assert len({tuple(row) for row in ids["hf"].tolist()}) > 1, ids["hf"]  # the rows differ: the ids can tell


@thorough_only("the benchmark end to end, three spawned workers each importing its engine")
def test_the_benchmark_runs_each_contender_in_its_own_process_and_gathers_their_ids():
    command = [sys.executable, str(BENCH / "bench_whisper.py"), "--quick", "--threads", "1", "--repeats", "1",
               "--new-tokens", "4", "--batch", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=BENCH.parent)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    # contender, seconds, tok/s, its ratio to transformers' time, first call, ids: numbers, not judged
    rows = {m[1]: (m[2], m[3]) for line in done.stdout.splitlines()
            if (m := re.match(r"(hf|ct2|torch)\s+\d+\.\d{3}\s+\d+\.\d\s+(\d+\.\d\d)x\s+\d+\.\d\d\s+(.*)$", line))}
    assert rows == {"hf": ("1.00", "2/2 rows equal ct2's, 2/2 rows equal torch's"),
                    "ct2": (rows.get("ct2", ("?",))[0], "2/2 rows equal hf's, 2/2 rows equal torch's"),
                    "torch": (rows.get("torch", ("?",))[0], "2/2 rows equal hf's, 2/2 rows equal ct2's")}, done.stdout
    assert "median of 1 interleaved repeats" in done.stdout and "x hf" in done.stdout, done.stdout
    assert done.stdout.count("load average") == 2, done.stdout  # at the start and at the end
