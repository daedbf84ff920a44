"""What a review of the fourth walk's fixes found (issue 45, items 5-9 and 18): `train-check
--plot` writes a PNG whatever matplotlib's default format, and `TooLargeError` is importable from
`conformance` beside its sibling errors.
"""

from __future__ import annotations

import io

import pytest


def test_the_train_check_plot_is_a_png_whatever_matplotlibs_default_format():
    """`--plot` renders into memory (written atomically later); with no file name to go by,
    matplotlib would use `savefig.format` (a user's matplotlibrc may say pdf)."""
    matplotlib = pytest.importorskip("matplotlib")
    from conformance.check.training import StepResult, TrainCheck, plot_train_check

    report = TrainCheck(source="the default model", reference="numpy float64", steps=2, label_smoothing=0.0,
                        rows=[StepResult(step, "numpy float32", 2.0 / step, 2.0 / step, 0.0, 1e-7, "output.weight",
                                         None, 1e-7, 1e-4) for step in (1, 2)],
                        reference_losses=[2.0, 1.0])
    picture = io.BytesIO()
    with matplotlib.rc_context({"savefig.format": "pdf"}):
        width, height = plot_train_check(report, picture)
    assert picture.getvalue().startswith(b"\x89PNG\r\n\x1a\n"), picture.getvalue()[:8]
    assert (width, height) == (1100, 400)


def test_too_large_error_is_importable_from_conformance():
    import conformance
    from conformance.core.errors import TooLargeError

    assert conformance.TooLargeError is TooLargeError and "TooLargeError" in conformance.__all__
