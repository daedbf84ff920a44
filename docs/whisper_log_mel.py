"""Whisper's log-mel features in NumPy, as math to study: what openai-whisper's `log_mel_spectrogram`
(whisper/audio.py) computes from 16 kHz audio, one step per function. Not a dependency of rosetta:
its models take the features, and openai-whisper (or transformers' `WhisperFeatureExtractor`)
computes them. tests/backends/test_whisper_log_mel.py checks this file against openai-whisper itself.

    python docs/whisper_log_mel.py                 # prints the features of a 1-second chirp

    x[n]            the audio, 16000 samples a second (float)
    w[n]            = 0.5 - 0.5 cos(2 pi n / N), n = 0 .. N - 1, N = 400 (25 ms): the periodic Hann window
    x_pad           x with N / 2 samples reflected at each end (x[1 .. 200] reversed in front)
    X[t, k]         = sum_n x_pad[t H + n] w[n] exp(-2 pi i k n / N),  H = 160 (10 ms), k = 0 .. N / 2
    P[t, k]         = |X[t, k]|^2, the last frame t dropped: len(x) / H frames
    M               the mel filterbank (n_mels, N / 2 + 1): triangles on the Slaney mel scale, each
                    scaled to unit area (librosa.filters.mel(sr=16000, n_fft=400, n_mels), what
                    whisper/assets/mel_filters.npz stores)
    S[m, t]         = sum_k M[m, k] P[t, k]
    L               = log10(max(S, 1e-10))
    L'              = max(L, max(L) - 8)            (80 dB below the loudest value: the floor)
    features        = (L' + 4) / 4                  (n_mels, frames), about [-1, 1.5]

A 30-second window is 480000 samples, 3000 frames: the encoder's 1500 positions after the stride-2
convolution. openai-whisper pads a shorter clip with zeros to 30 s first (`pad_or_trim`, or
`padding=N_SAMPLES` in `transcribe`), and the floor is taken over the whole window.
"""

from __future__ import annotations

import numpy as np

SAMPLE_RATE = 16000
N_FFT = 400  # 25 ms windows
HOP_LENGTH = 160  # 10 ms between frames


def hann_window(n: int = N_FFT) -> np.ndarray:
    """w[j] = 0.5 - 0.5 cos(2 pi j / n): the periodic Hann window (torch.hann_window's default), whose
    period is n, not n - 1 (NumPy's np.hanning is the symmetric one)."""
    return 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)


def power_spectrogram(audio: np.ndarray, n_fft: int = N_FFT, hop: int = HOP_LENGTH) -> np.ndarray:
    """P (frames, n_fft / 2 + 1): |STFT|^2 of the audio, centred frames (reflect padding of n_fft / 2
    each side, as torch.stft(center=True)), the last frame dropped, as openai-whisper drops it."""
    padded = np.pad(np.asarray(audio, dtype=np.float64), n_fft // 2, mode="reflect")
    count = 1 + (len(padded) - n_fft) // hop
    starts = hop * np.arange(count)[:, None]  # (T, 1)
    frames = padded[starts + np.arange(n_fft)[None, :]]  # (T, n_fft): frame t starts at sample t * hop
    spectrum = np.fft.rfft(frames * hann_window(n_fft), axis=-1)  # (T, n_fft / 2 + 1)
    return (np.abs(spectrum) ** 2)[:-1]


def hz_to_mel(f: np.ndarray) -> np.ndarray:
    """The Slaney mel scale (librosa's default, htk=False): linear below 1 kHz, 200/3 Hz a mel;
    logarithmic above it, 27 mels for each factor of 6.4."""
    f = np.asarray(f, dtype=np.float64)
    linear = f / (200.0 / 3)
    step = np.log(6.4) / 27.0
    return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-12) / 1000.0) / step, linear)


def mel_to_hz(m: np.ndarray) -> np.ndarray:
    """The inverse of `hz_to_mel`."""
    m = np.asarray(m, dtype=np.float64)
    step = np.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(step * (m - 15.0)), (200.0 / 3) * m)


def mel_filterbank(n_mels: int, sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """M (n_mels, n_fft / 2 + 1): n_mels triangles whose corners are n_mels + 2 points evenly spaced
    on the mel scale from 0 Hz to sample_rate / 2, each triangle rising from its left corner to its
    centre and falling to its right, evaluated at the FFT bins' frequencies, then scaled by
    2 / (right - left) in Hz so each has unit area (librosa's norm="slaney")."""
    bins = np.linspace(0.0, sample_rate / 2, 1 + n_fft // 2)  # (K,) each bin's frequency in Hz
    corners = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sample_rate / 2), n_mels + 2))  # (n_mels + 2,)
    width = np.diff(corners)  # (n_mels + 1,)
    below = (bins[None, :] - corners[:-2, None]) / width[:-1, None]  # rising edge, (n_mels, K)
    above = (corners[2:, None] - bins[None, :]) / width[1:, None]  # falling edge
    triangles = np.maximum(0.0, np.minimum(below, above))
    return triangles * (2.0 / (corners[2:] - corners[:-2]))[:, None]


def log_mel_spectrogram(audio: np.ndarray, n_mels: int = 80, padding: int = 0, filters: np.ndarray | None = None):
    """Whisper's features (n_mels, frames) of `audio` (16 kHz), in float64: `padding` zero samples
    appended first (openai-whisper's keyword); `filters` the filterbank to use (default
    `mel_filterbank(n_mels)`; openai-whisper reads its float32 copy from mel_filters.npz)."""
    audio = np.asarray(audio, dtype=np.float64)
    if padding > 0:
        audio = np.pad(audio, (0, padding))
    power = power_spectrogram(audio)  # (T, K)
    filters = mel_filterbank(n_mels) if filters is None else np.asarray(filters, dtype=np.float64)
    mel = filters @ power.T  # (n_mels, T)
    log = np.log10(np.maximum(mel, 1e-10))
    log = np.maximum(log, log.max() - 8.0)
    return (log + 4.0) / 4.0


def main() -> None:
    t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
    chirp = np.sin(2 * np.pi * (200 + 1800 * t) * t)  # 200 Hz rising to 3.8 kHz over one second
    features = log_mel_spectrogram(chirp)
    print(f"features {features.shape} (n_mels, frames), min {features.min():.3f}, max {features.max():.3f}")
    print("the loudest mel band per 100 ms:", features.argmax(0)[::10].tolist())


if __name__ == "__main__":
    main()
