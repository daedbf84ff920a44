"""The built-in default: a trained digit-reversal model, greedy decoding in every backend, pictures."""

from pathlib import Path

import numpy as np
import pytest

import impl_numpy
from conformance import InputError
from conformance.check import backends, toy
from conformance.core import checkpoint
from conformance.check.backends import Target
from conformance.cli import main
from conformance.check.compare import to_numpy
from conformance.check.defaults import DEFAULT_CHECKPOINT, default_model

TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_toy.py"


def test_the_default_checkpoint_is_shipped_small_and_self_describing():
    assert DEFAULT_CHECKPOINT.exists(), "run examples/train_toy.py to create it"
    assert DEFAULT_CHECKPOINT.stat().st_size <= 2_000_000
    config, params = checkpoint.load(DEFAULT_CHECKPOINT)
    assert config.notes["task"] == toy.TASK
    assert config.tgt_vocab_size == toy.VOCAB_SIZE and config.pad_id == toy.PAD
    assert default_model()[2].startswith("built-in default")


# examples/train_toy.py trains on batches from seed 0 and stops early on `toy.held_out()` (seed
# 12345): that set chose the checkpoint, so it cannot grade it. The grade is on sources it has
# never seen.
UNSEEN_SEED = 31415


@pytest.fixture(scope="module")
def generated():
    """Greedy outputs of every installed backend on sources neither training nor early stopping saw (float32, CPU)."""
    config, params, _ = default_model()
    assert UNSEEN_SEED not in (0, 12345) and "held_out(seed" not in TRAIN_SCRIPT.read_text()
    src = toy.held_out(seed=UNSEEN_SEED)
    results = {}
    for name, reason in backends.availability().items():
        if reason:
            continue
        model = backends.build(Target(name, "cpu", "float32"), config, params)
        if name == "jax":  # bound the compiles: one per bucket, not one per prefix length
            import impl_jax

            model = impl_jax.Model(config, params, dtype="float32", buckets=(4, 8, 16))
        results[name] = to_numpy(model.generate(src, max_len=config.max_len, bos_id=toy.BOS, eos_id=toy.EOS))
    return src, results


def test_trained_default_reaches_95_percent_on_unseen_inputs(generated):
    src, results = generated
    for name, tokens in results.items():
        accuracy = toy.exact_match(tokens, src)
        assert accuracy >= 0.95, f"{name}: exact match on unseen sources {accuracy:.3f} < 0.95"


def test_the_grading_set_is_not_the_early_stopping_set():
    graded, early_stopping = toy.held_out(seed=UNSEEN_SEED), toy.held_out()
    assert graded.shape[0] == early_stopping.shape[0]
    assert not any(np.array_equal(a, b) for a, b in zip(graded, early_stopping))


def test_every_backend_decodes_identical_tokens(generated):
    src, results = generated
    assert "numpy" in results and len(results) >= 2, f"only {sorted(results)} installed"
    reference = results["numpy"]
    for name, tokens in results.items():
        assert tokens.shape == reference.shape, name
        rows = np.flatnonzero((tokens != reference).any(axis=1))
        assert rows.size == 0, f"{name} decodes differently from numpy in {rows.size} rows, first {rows[:1]}"


def test_generate_refuses_bad_arguments():
    config, params, _ = default_model()
    model = impl_numpy.Model(config, params)
    src = np.array([toy.encode_text("123")])
    for kwargs, argument in ((dict(max_len=0), "max_len"), (dict(max_len=config.max_len + 1), "max_len"),
                             (dict(bos_id=-1), "bos_id"), (dict(eos_id=config.tgt_vocab_size), "eos_id")):
        call = dict(max_len=5, bos_id=toy.BOS, eos_id=toy.EOS) | kwargs
        with pytest.raises(InputError) as info:
            model.generate(src, **call)
        assert info.value.argument == argument


def test_rosetta_generate_prints_the_reversal(capsys):
    for backend in ("numpy", "torch", "jax"):
        if backends.availability([backend])[backend]:
            continue
        assert main(["generate", "--src", "3 1 4 1 5", "--backend", backend]) == 0
        assert capsys.readouterr().out.strip() == "5 1 4 1 3", backend


def decoded_png(path) -> np.ndarray:
    """The picture's pixels (height, width, channels), decoded: a truncated or corrupt file fails."""
    from matplotlib import image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    pixels = image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[2] in (3, 4)
    assert np.ptp(pixels[..., :3]) > 0.5, "a blank picture"
    return pixels


def test_rosetta_attention_draws_every_layer_and_head(tmp_path, capsys):
    out = tmp_path / "attn.png"
    assert main(["attention", "--src", "3 1 4 1 5 9", "--out", str(out)]) == 0
    config, _, _ = default_model()
    blocks = config.n_encoder_layers + 2 * config.n_decoder_layers
    # One 2.6-inch panel per head and block at 100 dpi, plus a margin.
    height, width, _ = decoded_png(out).shape
    assert (width, height) == (int((2.6 * config.n_heads + 0.6) * 100), int((2.6 * blocks + 0.6) * 100))
    assert "blocks" in capsys.readouterr().out


def test_rosetta_attention_queries_are_what_the_decoder_read(tmp_path, monkeypatch):
    """<bos> and the generated digits; not the final <eos>, which was written, never read."""
    from conformance.check import plots

    drawn = {}
    draw = plots.plot_attention
    monkeypatch.setattr(plots, "plot_attention", lambda attention, src_labels, tgt_labels, *a, **k: (
        drawn.update(src=src_labels, tgt=tgt_labels, attention=attention), draw(attention, src_labels, tgt_labels, *a, **k))[1])
    assert main(["attention", "--src", "3 1 4 1 5 9", "--out", str(tmp_path / "attn.png")]) == 0
    assert drawn["src"] == "3 1 4 1 5 9".split()
    assert drawn["tgt"] == ["<bos>", "9", "5", "1", "4", "1", "3"]
    assert drawn["attention"]["decoder.0.cross"].shape[-2:] == (7, 6)


def test_rosetta_check_plot_draws_the_errors(tmp_path):
    out = tmp_path / "check.png"
    assert main(["check", "--backends", "numpy", "--plot", str(out)]) == 0
    height, width, _ = decoded_png(out).shape
    assert height == 480 and width >= 800


def test_what_the_readme_says_about_the_default_models_attention():
    """Last decoder layer: every head reads source S - 1 - t to write output t (an anti-diagonal).
    First layer: only head 1 draws one, a row lower (query t reads S - t, where the token it was
    fed came from); the others do not."""
    config, params, _ = default_model()
    model = impl_numpy.Model(config, params, dtype="float64")
    src = np.array([toy.encode_text("3 1 4 1 5 9")])
    S = src.shape[1]
    tgt = np.array([[toy.BOS] + toy.encode_text("9 5 1 4 1 3")])
    cross = {i: model(src, tgt).attention[f"decoder.{i}.cross"][0].argmax(-1) for i in range(config.n_decoder_layers)}
    last, first = cross[config.n_decoder_layers - 1], cross[0]  # (H, T): the source position each query reads most
    assert (last[:, :S] == [S - 1 - t for t in range(S)]).all(), last
    assert (first[1, 1:] == [S - t for t in range(1, S + 1)]).all(), first
    anti_diagonal = [(first[h, :S] == [S - 1 - t for t in range(S)]).all() for h in range(config.n_heads)]
    assert not any(anti_diagonal), "then the README could say more about the first layer"


def test_load_keeps_the_checkpoints_dtype_unless_told():
    """README: `impl_numpy.load(path)` computes in the checkpoint's dtype; the oracle asks for float64."""
    stored = {v.dtype for v in checkpoint.load(DEFAULT_CHECKPOINT)[1].values()}
    assert stored == {np.dtype("float32")}
    assert impl_numpy.load(DEFAULT_CHECKPOINT).dtype == np.float32
    assert impl_numpy.load(DEFAULT_CHECKPOINT, dtype="float64").dtype == np.float64


# -- the toy model's trained range: a source outside it is warned about (issue 45) -------------


@pytest.mark.parametrize("src, digits", [("7", 1), ("3 1", 2), ("3 1 4 1 5 9 2 6 5 3 5 8 9", 13)])
def test_a_toy_source_outside_the_trained_range_is_warned_about(src, digits, capsys):
    assert main(["generate", "--src", src, "--backend", "numpy"]) == 0
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if "warning:" in line]
    assert len(warning) == 1, err
    assert f"trained on sources of {toy.MIN_DIGITS} to {toy.MAX_DIGITS} digits" in warning[0], warning[0]
    assert f"{digits} digit" in warning[0], warning[0]


@pytest.mark.parametrize("src", ["3 1 4", "3 1 4 1 5 9 2 6 5 3 5 8"])
def test_a_toy_source_in_the_trained_range_gets_no_warning(src, capsys):
    assert main(["generate", "--src", src, "--backend", "numpy"]) == 0
    captured = capsys.readouterr()
    assert "warning" not in captured.err, captured.err
    assert captured.out.split() == src.split()[::-1]


def test_the_toy_range_is_stated_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert f"{toy.MIN_DIGITS}-{toy.MAX_DIGITS} digits" in " ".join(capsys.readouterr().out.split())


def test_the_range_warning_reads_ids_rows_too():
    """The toy model's ids form ("6,4,7"), one row at a time, padding not counted."""
    src = np.array([[6, 4, 7, 0], [6, 4, 7, 8]])
    assert toy.range_warning(src) is None
    assert "row 0 has 1 digit" in toy.range_warning(np.array([[6, 0, 0], [6, 4, 7]]))
