"""impl_torch's CUDA graph of the training step (impl_torch/graphs.py, `TrainRoom`) gives
`loss_and_grads` and `train_step` the eager step's loss, gradients and parameters, bit for bit.

On the CPU the room runs through `graphs.Recorded`, a stand-in for CUDA capture that records by
running (here refusing host reads while it records, as a capture does): that exercises the key,
the static ids and targets loaded per call, the flat buffer of gradients copied out at every call,
and which calls stay eager. On a CUDA device the same
comparison runs with a real graph.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed")

import impl_torch  # noqa: E402
from impl_torch import graphs  # noqa: E402

from conformance.core.errors import InputError  # noqa: E402
from conformance.core.dropout import draw_dropout  # noqa: E402
from conformance.core.presets import preset  # noqa: E402

SIZES = dict(src_vocab_size=13, tgt_vocab_size=13, d_model=16, n_heads=2, d_ff=24, n_encoder_layers=1,
             n_decoder_layers=2, max_len=12)
# -inf and finite fills, shared and tied embeddings, final_logits_bias, pre-LN
PRESETS = ("paper", "hf-marian", "annotated-transformer", "llmhub")
DTYPES = {"float32": ("float32", None), "mixed bfloat16": ("bfloat16", "float32"), "float64": ("float64", None)}


def batch(config, seed: int, src_len: int = 6, tgt_len: int = 5):
    """(3, src_len) sources and (3, tgt_len) targets and labels, with padding that differs with
    the seed: an empty source row (a query with no key: the loss's empty-row rule; its labels are
    pad_id, since with a -inf fill its logits are NaN) and padded labels."""
    rng = np.random.default_rng(seed)
    real = np.array([i for i in range(config.src_vocab_size) if i != config.pad_id])
    src = rng.choice(real, size=(3, src_len))
    tgt = rng.choice(real, size=(3, tgt_len + 1))
    src[0] = config.pad_id
    src[1, 2 + seed % 3:] = config.pad_id
    tgt[2, 1 + seed % 3:] = config.pad_id
    labels = np.where(tgt[:, 1:] == config.pad_id, config.pad_id, tgt[:, 1:])
    labels[0] = config.pad_id
    return src, tgt[:, :-1].copy(), labels


HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__")


class Counted(graphs.Recorded):
    """`Recorded`, counting its recordings, and as strict as a CUDA capture about the host: while
    it records, reading a tensor's values on the host raises, as it does under capture on a GPU
    (where a recording that reads them fails with "Cannot copy between CPU and CUDA tensors
    during CUDA graph capture")."""

    captured = 0

    def record(self, fn):
        Counted.captured += 1

        def refuse(name):
            def read(*args, **kwargs):
                raise RuntimeError(f"Tensor.{name} reads a tensor on the host while a graph records")
            return read

        saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
        try:
            for name in HOST_READS:
                setattr(torch.Tensor, name, refuse(name))
            return super().record(fn)
        finally:
            for name, method in saved.items():
                setattr(torch.Tensor, name, method)


@pytest.fixture
def recorded(monkeypatch):
    monkeypatch.setattr(graphs, "CAPTURES", {"cpu": Counted, "cuda": graphs.CudaCapture})
    monkeypatch.setattr(graphs, "ENABLED", True)
    Counted.captured = 0


def model_pair(config, dtype: str, device: str = "cpu"):
    """Two models of the same weights, each with its Adam."""
    compute, stored = DTYPES[dtype]
    params = impl_torch.Model(config, dtype="float64").state_dict()
    models = [impl_torch.Model(config, params, compute, device=device, param_dtype=stored) for _ in range(2)]
    return [(model, impl_torch.Adam(model, config.d_model)) for model in models]


def assert_equal(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    assert torch.equal(got, want), (what, (got.double() - want.double()).abs().max())


def steps_side_by_side(config, dtype, device, seeds):
    """`train_step`s of one model with graphs on and of its twin with graphs off, on the same
    batches; every loss, gradient and parameter compared bit for bit, and each step's gradients
    checked again after the next step (a replay must not overwrite what a caller holds)."""
    (graphed, graphed_opt), (eager, eager_opt) = model_pair(config, dtype, device)
    held = []
    for step, seed in enumerate(seeds):
        src, tgt, labels = batch(config, seed)
        loss, grads = graphed.loss_and_grads(src, tgt, labels, label_smoothing=0.1)
        with graphs.switched_off():
            want_loss, want_grads = eager.loss_and_grads(src, tgt, labels, label_smoothing=0.1)
        what = f"{config.position}, {dtype}, step {step + 1}"
        assert_equal(loss, want_loss, f"loss, {what}")
        assert list(grads) == list(want_grads)
        for name in grads:
            assert_equal(grads[name], want_grads[name], f"{name}, {what}")
        for earlier, copies in held:
            for name in earlier:
                assert_equal(earlier[name], copies[name], f"{name} of an earlier step, {what}")
        held.append(({"loss": loss, **grads}, {"loss": loss.clone(), **{name: g.clone() for name, g in grads.items()}}))
        graphed_opt.step(grads)
        eager_opt.step(want_grads)
    for (name, got), want in zip(graphed.state_dict().items(), eager.state_dict().values()):
        assert_equal(got, want, f"parameter {name} after {len(seeds)} steps")
    return graphed


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_replayed_training_steps_give_the_eager_loss_gradients_and_parameters(recorded, name, dtype):
    """First call eager (the key is new), second records the room, the rest replay, each on
    other ids and labels of the same shapes, with an Adam step in place between them."""
    model = steps_side_by_side(preset(name, **SIZES), dtype, "cpu", seeds=(1, 2, 3, 4, 5))
    assert Counted.captured == 1 and len(model._train_rooms) == 1


def test_a_new_shape_or_new_parameters_make_a_new_room(recorded):
    """Each call equals the eager call on the same model; the rooms are counted as keys change."""
    config = preset("hf-marian", **SIZES)
    model = impl_torch.Model(config, dtype="float32")

    def call(src, tgt, labels, **options):
        loss, grads = model.loss_and_grads(src, tgt, labels, **options)
        with graphs.switched_off():
            want_loss, want_grads = model.loss_and_grads(src, tgt, labels, **options)
        assert_equal(loss, want_loss, f"loss, {options}")
        for name in grads:
            assert_equal(grads[name], want_grads[name], f"{name}, {options}")

    src, tgt, labels = batch(config, 1)
    for _ in range(3):
        call(src, tgt, labels)
    assert len(model._train_rooms) == 1 and Counted.captured == 1
    for _ in range(2):  # another ε: another key
        call(src, tgt, labels, label_smoothing=0.1)
    assert len(model._train_rooms) == 2
    # New parameter tensors of the same dtype and shapes (a room would read the old ones): a new
    # key; the least recently used room goes
    model.load_state_dict({name: t * 1.5 for name, t in model.state_dict().items()}, assign=True)
    for _ in range(2):
        call(src, tgt, labels)
    src, tgt, labels = batch(config, 1, src_len=7, tgt_len=4)  # another shape
    for _ in range(2):
        call(src, tgt, labels)
    assert len(model._train_rooms) == graphs.MAX_TRAIN_ROOMS and Counted.captured == 4
    graphs.release(model)
    assert not model.__dict__.get("_train_rooms")


def test_calls_that_must_stay_eager_keep_no_room(recorded, monkeypatch):
    """Dropout masks, autocast and inference mode (where loss_and_grads fails as it does eagerly),
    anomaly detection, module and parameter hooks, a TorchFunctionMode, a compiled model, a
    subclass, graphs switched off, and the shipped table (no CPU capture)."""
    config = preset("paper", **SIZES)
    src, tgt, labels = batch(config, 1)

    def keeps_no_room(model, **options):
        for _ in range(3):
            model.loss_and_grads(src, tgt, labels, **options)
        return not model.__dict__.get("_train_rooms")

    masks = draw_dropout(config, *src.shape, tgt.shape[1], rate=0.1, seed=0)
    assert keeps_no_room(impl_torch.Model(config, dtype="float32"), dropout=masks)
    model = impl_torch.Model(config, dtype="float32")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the model refuses autocast, before any room
        for _ in range(3):
            with pytest.raises(InputError, match="torch.autocast"):
                model.loss_and_grads(src, tgt, labels)
    assert not model.__dict__.get("_train_rooms")
    with graphs.switched_off():
        assert keeps_no_room(impl_torch.Model(config, dtype="float32"))
    model = impl_torch.Model(config, dtype="float32")
    with torch.inference_mode():
        for _ in range(3):
            with pytest.raises(RuntimeError):
                model.loss_and_grads(src, tgt, labels)
    assert not model.__dict__.get("_train_rooms")
    with torch.autograd.set_detect_anomaly(True):
        assert keeps_no_room(impl_torch.Model(config, dtype="float32"))
    hooked = impl_torch.Model(config, dtype="float32")  # a replay would not run the hook
    hooked.decoder.layers[0].register_forward_hook(lambda module, args, output: None)
    assert keeps_no_room(hooked)
    hooked = impl_torch.Model(config, dtype="float32")
    next(hooked.parameters()).register_hook(lambda grad: grad)
    assert keeps_no_room(hooked)
    class PassThrough(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with PassThrough():
        assert keeps_no_room(impl_torch.Model(config, dtype="float32"))

    class Subclass(impl_torch.Model):
        pass

    assert keeps_no_room(Subclass(config, dtype="float32"))
    compiled = impl_torch.Model(config, dtype="float32")
    compiled.__dict__["_compiled_call_impl"] = compiled._call_impl  # what nn.Module.compile sets, without Inductor
    assert keeps_no_room(compiled)
    monkeypatch.setattr(graphs, "CAPTURES", {"cuda": graphs.CudaCapture})
    assert keeps_no_room(impl_torch.Model(config, dtype="float32"))
    assert Counted.captured == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_cuda_graph_gives_the_eager_training_steps(dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False (the CPU stand-in runs above)")
    for name in ("paper", "hf-marian"):
        model = steps_side_by_side(preset(name, **SIZES), dtype, "cuda", seeds=(1, 2, 3, 4))
        assert len(model._train_rooms) == 1


@pytest.mark.parametrize("setting", ["float32 matmul precision", "deterministic algorithms", "an SDPA backend",
                                     "requires_grad"])
def test_a_setting_that_chooses_kernels_makes_a_new_room(recorded, setting):
    """A replay keeps its recording's kernels, so each setting that chooses them is in the key."""
    config = preset("paper", **SIZES)
    model = impl_torch.Model(config, dtype="bfloat16", param_dtype="float32")  # mixed: frozen parameters train too
    src, tgt, labels = batch(config, 1)
    for _ in range(2):
        model.loss_and_grads(src, tgt, labels)
    assert Counted.captured == 1
    changes = {
        "float32 matmul precision": lambda: torch.set_float32_matmul_precision("medium"),
        "deterministic algorithms": lambda: torch.use_deterministic_algorithms(True),
        "an SDPA backend": lambda: torch.backends.cuda.enable_flash_sdp(False),
        "requires_grad": lambda: next(model.parameters()).requires_grad_(False),
    }
    restore = (torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled(),
               torch.backends.cuda.flash_sdp_enabled())
    try:
        changes[setting]()
        for _ in range(2):
            model.loss_and_grads(src, tgt, labels)
    finally:
        torch.set_float32_matmul_precision(restore[0])
        torch.use_deterministic_algorithms(restore[1])
        torch.backends.cuda.enable_flash_sdp(restore[2])
    assert Counted.captured == 2 and len(model._train_rooms) == 2


class Failing(graphs.Recorded):
    """A capture whose recording fails, as one out of memory would."""

    def record(self, fn):
        raise torch.OutOfMemoryError("no memory for the graph's pool (planted)")


def test_a_recording_that_fails_warns_once_and_those_calls_run_eagerly(monkeypatch):
    monkeypatch.setattr(graphs, "CAPTURES", {"cpu": Failing})
    monkeypatch.setattr(graphs, "ENABLED", True)
    config = preset("paper", **SIZES)
    model = impl_torch.Model(config, dtype="float32")
    src, tgt, labels = batch(config, 1)
    with graphs.switched_off():
        want_loss, want_grads = model.loss_and_grads(src, tgt, labels)
    model.loss_and_grads(src, tgt, labels)  # the key's first call: eager
    with pytest.warns(RuntimeWarning, match="recording the training step as a CUDA graph failed.*planted"):
        loss, grads = model.loss_and_grads(src, tgt, labels)
    assert_equal(loss, want_loss, "the loss of the call whose recording failed")
    for name in grads:
        assert_equal(grads[name], want_grads[name], name)
    assert not graphs.checked_static_input(src) and not getattr(graphs._LOCAL, "recording", ())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, no second attempt
        for _ in range(2):
            model.loss_and_grads(src, tgt, labels)
    assert not model._train_rooms


def test_switched_off_holds_on_its_own_thread_only(recorded):
    import threading

    config = preset("paper", **SIZES)
    model = impl_torch.Model(config, dtype="float32")
    src, tgt, labels = batch(config, 1)
    seen = []
    with graphs.switched_off():
        thread = threading.Thread(target=lambda: seen.append(graphs.enabled()))
        thread.start()
        thread.join()
        for _ in range(2):
            model.loss_and_grads(src, tgt, labels)
        assert not graphs.enabled() and not model.__dict__.get("_train_rooms")
    assert seen == [True] and graphs.enabled()


def test_the_suites_gradient_property_checks_a_replayed_step(recorded, monkeypatch):
    """The conformance suite calls `loss_and_grads` three times on each example's model: on a
    CUDA device the second call records the step, and the third replays the graph on other labels,
    so the suite holds the replayed gradients to the oracle too (here through the CPU stand-in:
    one recording and one replay per example, each example's model being new)."""
    from conformance.check.backends import Target
    from conformance.suite import runner
    from conformance.suite.test_gradients import test_gradients_match_the_oracle as gradients

    target, examples, replays = Target("torch", "cpu", "float64"), [], []
    real_gradients, real_record = runner.gradients, Counted.record

    def counted(on, training, *more):
        examples.append(on) if on == target else None
        return real_gradients(on, training, *more)

    def record(self, fn):
        replay, out = real_record(self, fn)
        return (lambda: replays.append(1) or replay()), out

    monkeypatch.setattr(runner, "gradients", counted)
    monkeypatch.setattr(Counted, "record", record)
    gradients(target=target)
    assert examples and Counted.captured == len(replays) == len(examples), (
        f"{Counted.captured} steps recorded and {len(replays)} replayed in {len(examples)} examples")
