"""CTranslate2 runs a small model on one intra-op thread in `rosetta compare` and `rosetta check`.

Its default is 4 OpenMP threads; on a machine with fewer free cores each of a tiny model's
operations waits at a barrier for a thread the scheduler has put aside: `rosetta compare` on a
2+2-layer T5 directory took 50-59 s on the shared 2-core machine, 44.5 s of it one beam-4
translate_batch, which takes 0.48 s on one thread (benchmarks/bench_ctranslate2_compare.py has the
interleaved measurement). `intra_threads` gives one thread below 2M parameters on the CPU, the
user's OMP_NUM_THREADS when set, and CTranslate2's own default otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest

ctranslate2 = pytest.importorskip("ctranslate2", reason="the model runs in CTranslate2")
pytest.importorskip("transformers", reason="CTranslate2's converter reads a transformers folder")

from conformance import preset  # noqa: E402
from conformance.check.ctranslate2 import target as ctranslate2_check  # noqa: E402
from conformance.check.ctranslate2.compare import compare_ctranslate2  # noqa: E402
from conformance.check.ctranslate2.model import SMALL_MODEL_PARAMETERS, intra_threads  # noqa: E402
from conformance.check.report import fixed_batch  # noqa: E402
from conformance.core.params import param_bytes  # noqa: E402


def test_the_thread_count_by_size_device_and_the_users_choice(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    tiny = ctranslate2_check.example_model()[0]
    base = preset("hf-marian", d_model=512, n_heads=8, d_ff=2048, src_vocab_size=32000, tgt_vocab_size=32000)
    assert param_bytes(tiny, "float64") // 8 < SMALL_MODEL_PARAMETERS <= param_bytes(base, "float64") // 8
    assert intra_threads(tiny, "cpu") == 1
    assert intra_threads(base, "cpu") == 0  # CTranslate2's own default for a model that fills the cores
    assert intra_threads(tiny, "cuda") == 0
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert intra_threads(tiny, "cpu") == 3 and intra_threads(base, "cpu") == 3


def test_compare_makes_its_translators_with_one_thread(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    config, params = ctranslate2_check.example_model()
    folder = ctranslate2_check.convert(config, params, tmp_path / "ct2")
    made = []
    real = ctranslate2.Translator

    def counted(*args, **kwargs):
        made.append(kwargs.get("intra_threads"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ctranslate2, "Translator", counted)
    src, tgt = fixed_batch(config)
    report = compare_ctranslate2(str(folder), None, src, tgt, oracle=(config, params, None),
                                 compute_types=("float32", "int8"), beams=(1, 4), max_len=12)
    assert made == [1, 1], made
    assert report.passed, report.table()
    assert np.isfinite(report.rows[0].position_error).all()
