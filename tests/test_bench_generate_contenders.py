"""benchmarks/bench_generate.py's issue-44 contenders compare equal computations: CTranslate2,
converted from the benchmark's own random MarianMTModel, and transformers and impl_torch on the
same weights give the same ids on every row, each row running all its steps (the end and pad ids
barred), greedy and beam 4. A small config: seconds, no compile."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.xdist_group("ctranslate2")
pytest.importorskip("ctranslate2", reason="the [ctranslate2] extra is not installed")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_generate", BENCH / "bench_generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def contenders(bench, tmp_path_factory):
    import impl_torch
    from conformance.convert import from_hf_marian

    sizes = bench.QUICK
    hf = bench.marian(sizes, "cpu")
    config, params = from_hf_marian(hf)
    pad, bos, eos = bench.ids(sizes)
    translator, reason = bench.ct2_translator(config, params, "cpu", "float32", tmp_path_factory.mktemp("ct2") / "model")
    assert translator is not None, reason
    src = np.random.default_rng(0).integers(2, pad, size=(4, 9))
    tokens = [[str(i) for i in row] for row in src.tolist()]
    ours = impl_torch.Model(config, params, "float32")
    return {
        "ct2": lambda beams: bench.ct2_generate(translator, tokens, NEW_TOKENS, beams),
        "hf": lambda beams: bench.hf_generate(hf, torch.as_tensor(src), NEW_TOKENS, beams, [eos, pad]).numpy(),
        "torch": lambda beams: np.asarray(ours.generate(src, NEW_TOKENS, bos, eos, num_beams=beams,
                                                       banned_ids=[eos, pad])),
    }, (pad, eos)


@pytest.mark.parametrize("beams", [1, 4])
def test_ctranslate2_transformers_and_impl_torch_give_the_same_ids(contenders, bench, beams):
    runs, (pad, eos) = contenders
    ids = {name: run(beams) for name, run in runs.items()}
    for name, got in ids.items():
        assert got.shape == (4, NEW_TOKENS), f"{name}, {beams} beams: ids {got.shape}, expected every row to run " \
                                              f"all {NEW_TOKENS} steps"
        assert not np.isin(got, [pad, eos]).any(), f"{name}, {beams} beams: a barred id (end {eos}, pad {pad}) in {got}"
    for name in ("ct2", "torch"):
        assert (ids[name] == ids["hf"]).all(), f"{name} against transformers, {beams} beams:\n{ids[name]}\n{ids['hf']}"
    line = bench.agreement({(n, "s"): ids[n] for n in ids}, list(ids), "torch", "s")
    assert line == "same rows: 4/4 ct2, 4/4 hf", line
