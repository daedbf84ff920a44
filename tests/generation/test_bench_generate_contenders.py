"""benchmarks/bench_generate.py's issue-44 contenders compare equal computations: CTranslate2,
converted from the benchmark's own random MarianMTModel, and transformers and impl_torch on the
same weights give the same ids on every row, each row running all its steps (the end and pad ids
barred), greedy and beam 4; and the benchmark itself, each contender in its own worker process, runs
end to end and gathers those ids from its workers. A small config: seconds, no compile."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from thorough import thorough_only

pytestmark = pytest.mark.xdist_group("ctranslate2")
pytest.importorskip("ctranslate2", reason="the [ctranslate2] extra is not installed")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
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


@thorough_only("two spawned workers, each importing its engine (63 s loaded); the in-process test above gives the "
               "same contenders' ids in CI")
def test_the_benchmark_runs_each_contender_in_its_own_process_and_gathers_their_ids():
    """`bench_generate.py` as a user runs it (its default arrangement): a spawned worker for torch and
    one for ct2, each building the weights itself; their tables' ids must agree row for row."""
    command = [sys.executable, str(BENCH / "bench_generate.py"), "--quick", "--contenders", "torch,ct2",
               "--threads", "1", "--repeats", "1", "--new-tokens", "6", "--batch", "2", "--src-len", "5"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=BENCH.parent)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    header = next((line for line in done.stdout.splitlines() if line.startswith("batch 2, source 5")), None)
    assert header is not None and "each contender in its own process" in header, done.stdout
    rows = {}
    for line in done.stdout.splitlines():
        if match := re.match(r"(greedy|beam 4)\s+(torch|ct2)\s+[\d.]+\s.*?\s(same rows: .*)$", line):
            rows[match[1], match[2]] = match[3]
    expected = {("greedy", "torch"): "same rows: 2/2 ct2", ("greedy", "ct2"): "same rows: 2/2 torch",
                ("beam 4", "torch"): "same rows: 2/2 ct2", ("beam 4", "ct2"): "same rows: 2/2 torch"}
    assert rows == expected, done.stdout


def test_the_int8_contender_quantises_every_linear_and_decodes_every_step(bench):
    """`torch-int8` (issue 57): every Linear of the encoder and decoder is torch.ao's dynamic int8
    Linear holding the float32 weight's transpose (quantised), the rest of the model is float32, and
    its generate runs every step without a barred id; its ids are reported, not held to float32's."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    import impl_torch
    from conformance.convert import from_hf_marian

    sizes = bench.QUICK
    config, params = from_hf_marian(bench.marian(sizes, "cpu"))
    reference = impl_torch.Model(config, params, "float32")
    model = bench.build("torch-int8", config, params, "cpu")
    from impl_torch.model import Linear

    ours = {n: m for n, m in reference.named_modules() if type(m) is Linear}
    quantised = {n: m for n, m in model.named_modules() if isinstance(m, DynamicLinear)}
    assert ours and quantised.keys() == ours.keys()
    assert not any(type(m) is Linear for m in model.modules())
    for name, module in quantised.items():
        weight = module.weight().dequantize()
        scale = module.weight().q_scale()
        assert torch.allclose(weight, ours[name].weight.T, atol=scale), name  # within one quantisation step
    assert model.dtype == torch.float32 and model.target_embedding.weight.dtype == torch.float32
    pad, bos, eos = bench.ids(sizes)
    src = np.random.default_rng(0).integers(2, pad, size=(4, 9))
    for beams in (1, 4):
        got = np.asarray(model.generate(src, NEW_TOKENS, bos, eos, num_beams=beams, banned_ids=[eos, pad]))
        assert got.shape == (4, NEW_TOKENS) and not np.isin(got, [pad, eos]).any(), got
