"""docs/whisper_log_mel.py, the NumPy log-mel that docs/whisper.md teaches, against openai-whisper's
own `log_mel_spectrogram` (whisper/audio.py) and the filterbank it ships (whisper/assets/mel_filters.npz,
read from the installed package: nothing is downloaded).

openai-whisper computes in float32 (torch.stft, a float32 filterbank); ours in float64. The features
are held to the tolerance table's float32 row, scaled by max(1, max |features|); measured on these
clips: 2.7e-6 (80 mels, with and without padding to 30 s) and 7.0e-6 (128 mels). Two slips a port
makes are shown to exceed it: NumPy's symmetric Hann window (np.hanning, 3.4e-2) and HTK's mel
scale (1.1).
"""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="openai-whisper computes the features with torch")
whisper = pytest.importorskip("whisper", reason="openai-whisper is in the test extra (README step 1)")

from whisper.audio import N_SAMPLES, mel_filters  # noqa: E402

from conformance.check.tolerances import tolerance  # noqa: E402

DOCS = Path(__file__).resolve().parents[2] / "docs" / "whisper_log_mel.py"


@pytest.fixture(scope="module")
def ours():
    return runpy.run_path(str(DOCS))


def clip() -> np.ndarray:
    """1.3 s of a rising chirp with noise, float32 (as whisper.load_audio gives), 20800 samples."""
    t = np.arange(20800) / 16000
    noise = np.random.default_rng(0).standard_normal(len(t))
    return (0.3 * np.sin(2 * np.pi * (300 + 2000 * t) * t) + 0.05 * noise).astype(np.float32)


def held(actual: np.ndarray, expected: np.ndarray) -> tuple[bool, float]:
    """(within the float32 row of the tolerance table, the largest |error|)."""
    error = float(np.abs(actual - expected).max())
    return error <= tolerance("float32").atol * max(1.0, float(np.abs(expected).max())), error


@pytest.mark.parametrize("n_mels", [80, 128])
def test_the_filterbank_is_the_one_openai_whisper_ships(ours, n_mels):
    shipped = mel_filters("cpu", n_mels).numpy()  # librosa.filters.mel(sr=16000, n_fft=400, n_mels), float32
    computed = ours["mel_filterbank"](n_mels)
    assert computed.shape == shipped.shape == (n_mels, 201)
    # float32's rounding of our float64 triangles, within one unit in the last place of the largest value
    assert np.abs(computed.astype(np.float32) - shipped).max() <= np.spacing(np.abs(shipped).max())


@pytest.mark.parametrize("n_mels, padding", [(80, 0), (80, N_SAMPLES - 20800), (128, 0)],
                         ids=["80 mels", "80 mels, padded to 30 s", "128 mels"])
def test_the_features_are_openai_whispers(ours, n_mels, padding):
    audio = clip()
    expected = whisper.log_mel_spectrogram(audio, n_mels=n_mels, padding=padding).numpy()
    actual = ours["log_mel_spectrogram"](audio, n_mels, padding)
    assert actual.shape == expected.shape == (n_mels, (len(audio) + padding) // 160)
    ok, error = held(actual, expected)
    assert ok and error > 0, error


@pytest.mark.parametrize("slip, replacements", [
    ("NumPy's symmetric Hann window", {"hann_window": lambda n=400: np.hanning(n)}),
    ("HTK's mel scale", {"hz_to_mel": lambda f: 2595 * np.log10(1 + np.asarray(f, float) / 700),
                         "mel_to_hz": lambda m: 700 * (10 ** (np.asarray(m, float) / 2595) - 1)}),
])
def test_the_check_tells_a_ports_slips(ours, monkeypatch, slip, replacements):
    """The check can fail: each slip, planted in the script's own functions, leaves the tolerance far behind."""
    audio = clip()
    expected = whisper.log_mel_spectrogram(audio).numpy()
    script = ours["log_mel_spectrogram"].__globals__  # the namespace the script's functions read
    for name, replacement in replacements.items():
        monkeypatch.setitem(script, name, replacement)
    ok, error = held(ours["log_mel_spectrogram"](audio), expected)
    assert not ok, f"{slip}: {error}"
