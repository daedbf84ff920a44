"""Compiling in the JAX backend: the persistent compilation cache (one call or one environment
variable), the notice before a long compile, the layer stacks under `lax.scan`, and LayerNorm as
one function under differentiation.

Each cache test runs fresh Python processes, because what it checks is what a second process
gains: the first fills the directory, the second loads its executables from it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from conformance.suite.profiles import ci_or_every
import impl_jax
from impl_jax import cache
from xla_emitters import run_with_xla_emitters

ROOT = Path(__file__).resolve().parents[3]

# One small model's forward pass, then what the process compiled and loaded.
PROGRAM = """
import json, os, sys, numpy as np
import impl_jax
from conformance import init_params
from impl_jax import compiled
if os.environ.get("TEST_FORCE_NO_TRITON_GEMM"):  # a GPU float32 choice, forced (a no-op on a CPU)
    compiled.triton_gemm = lambda platform, dtype: False
sys.path.insert(0, {tests!r})
from batches import SRC, TGT, small
config = small(d_ff=52)  # a config only this test compiles
impl_jax.Model(config, init_params(config, dtype=np.float32))(SRC, TGT)
stats = impl_jax.compile_stats()
print(json.dumps({{"compiles": stats["compiles"], "hits": stats["persistent_hits"],
                  "dir": str(impl_jax.persistent_cache_dir()),
                  "without_triton": compiled._JITS[(False, False)]._cache_size()}}))
"""


def run(env: dict[str, str]) -> dict:
    environment = {k: v for k, v in os.environ.items() if k not in ("ROSETTA_JAX_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    environment.update(env, PYTHONPATH=str(ROOT), ROSETTA_JAX_QUIET="1")
    done = subprocess.run([sys.executable, "-c", PROGRAM.format(tests=str(ROOT / "tests"))], env=environment,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_environment_variable_fills_the_cache_and_a_second_process_loads_from_it(tmp_path):
    directory = tmp_path / "jax-cache"
    first = run({"ROSETTA_JAX_CACHE": str(directory)})
    assert first["dir"] == str(directory.resolve())
    assert first["compiles"] == 2 and first["hits"] == 0  # _encode and _decode, compiled
    written = [p for p in directory.iterdir() if p.name.startswith("jit__traced")]
    assert len(written) == 2, sorted(p.name for p in directory.iterdir())
    second = run({"ROSETTA_JAX_CACHE": str(directory)})
    assert second["hits"] == 2, second  # both loaded, none compiled
    without = run({})
    assert without["hits"] == 0 and without["dir"] == "None"  # off unless asked for


def test_programs_compiled_without_triton_products_are_kept_and_loaded_by_the_cache(tmp_path):
    """The compile option of a GPU's float32 programs (`compiled.triton_gemm`) travels through the
    persistent cache: written by one process, loaded by the next."""
    env = {"ROSETTA_JAX_CACHE": str(tmp_path / "jax-cache"), "TEST_FORCE_NO_TRITON_GEMM": "1"}
    first = run(env)
    assert first["compiles"] == 2 and first["hits"] == 0 and first["without_triton"] == 2
    second = run(env)
    assert second["hits"] == 2 and second["without_triton"] == 2


def test_the_environment_variable_reads_on_off_and_a_directory(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(cache, "enable_persistent_cache", lambda path=None: calls.append(path) or path)
    for value in ("", "0", "off"):
        monkeypatch.setenv(cache.ENV, value)
        assert cache.enable_from_environment() is None
    monkeypatch.setenv(cache.ENV, "1")
    cache.enable_from_environment()
    monkeypatch.setenv(cache.ENV, str(tmp_path))
    cache.enable_from_environment()
    assert calls == [None, str(tmp_path)]


def test_enable_in_process_sets_every_option_and_clear_empties(tmp_path):
    import jax

    before = jax.config.jax_compilation_cache_dir
    try:
        directory = impl_jax.enable_persistent_cache(tmp_path / "c")
        assert directory == (tmp_path / "c").resolve() and directory.is_dir()
        assert impl_jax.persistent_cache_dir() == directory
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
        assert jax.config.jax_persistent_cache_enable_xla_caches == "all"
        (directory / "entry").write_text("x")
        impl_jax.clear_persistent_cache()
        assert directory.is_dir() and not any(directory.iterdir())
        impl_jax.disable_persistent_cache()
        assert impl_jax.persistent_cache_dir() is None
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()


def test_a_long_compile_prints_one_notice(monkeypatch, capsys):
    import numpy as np
    from conformance import init_params
    from impl_jax import compiled
    from batches import SRC, TGT, small

    monkeypatch.setattr(compiled, "NOTICE_AFTER", 0.0)  # every compile counts as long
    config = small(d_ff=56)
    impl_jax.Model(config, init_params(config, dtype=np.float32))(SRC, TGT)
    err = capsys.readouterr().err
    notices = [line for line in err.splitlines() if line.startswith("impl_jax: tracing and compiling")]
    assert len(notices) == 2 and "Model._encode" in notices[0] and "Model._decode" in notices[1], err
    impl_jax.Model(config, init_params(config, dtype=np.float32))(SRC, TGT)  # compiled: silent
    assert "impl_jax:" not in capsys.readouterr().err


def test_the_garbage_collector_pauses_while_a_new_program_traces(monkeypatch):
    """Off when each trace ends (JAX's event) and on again after the call; left alone by a cached
    call, by a user who disabled it, and with PAUSE_GC = False (where the probe sees it running)."""
    import gc

    import jax
    import numpy as np
    from conformance import init_params
    from impl_jax import compiled
    from batches import SRC, TGT, small

    seen: list[bool] = []  # gc.isenabled() as each trace inside impl_jax's calls ends

    def probe(event: str, duration: float, **_) -> None:
        # only traces inside impl_jax's calls (an eager jnp op may compile a helper program too)
        if event == compiled.TRACE_EVENTS[0] and recording and getattr(compiled._ACTIVE, "on", False):
            seen.append(gc.isenabled())

    impl_jax.clear_cache()  # every first call below traces, whatever this process compiled before
    recording = True
    jax.monitoring.register_event_duration_secs_listener(probe)
    try:
        config = small(d_ff=52)
        model = impl_jax.Model(config, init_params(config, dtype=np.float32))
        assert gc.isenabled()
        model(SRC, TGT)
        assert seen == [False, False] and gc.isenabled()  # _encode and _decode, paused for each
        model(SRC, TGT)  # cached: no trace
        assert seen == [False, False] and gc.isenabled()
        gc.disable()
        model(SRC[:2], TGT[:2])  # a new shape: traced, and the user's choice is kept
        assert seen[2:] == [False, False] and not gc.isenabled()
        gc.enable()
        monkeypatch.setattr(compiled, "PAUSE_GC", False)
        model(SRC[:1], TGT[:1])
        assert seen[4:] == [True, True] and gc.isenabled()
    finally:
        recording = False
        unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)  # not in every JAX
        if unregister is not None:
            unregister(probe)
        gc.enable()


def test_concurrent_pauses_enable_the_collector_when_the_last_ends():
    """The collector is one per process: two threads' overlapping pauses disable it once, and only
    the second to end enables it again; a collector disabled before any pause stays disabled."""
    import gc
    import threading

    from impl_jax import compiled

    def pausing(paused: threading.Event, go: threading.Event, done: threading.Event) -> None:
        compiled._pause_gc()
        paused.set()
        go.wait(10)
        compiled._resume_gc()
        done.set()

    try:
        for enabled_before in (True, False):
            (gc.enable if enabled_before else gc.disable)()
            events = [[threading.Event() for _ in range(3)] for _ in range(2)]
            threads = [threading.Thread(target=pausing, args=e) for e in events]
            for thread, (paused, _, _) in zip(threads, events):
                thread.start()
                assert paused.wait(10)
            assert not gc.isenabled()
            events[0][1].set()  # the first pause ends while the second still runs
            assert events[0][2].wait(10) and not gc.isenabled()
            events[1][1].set()
            assert events[1][2].wait(10)
            assert gc.isenabled() == enabled_before
            for thread in threads:
                thread.join(10)
    finally:
        gc.enable()


# -- The layer stacks under lax.scan -------------------------------------------------------------


def test_scanned_stacks_equal_the_unrolled_loop():
    """Scanned and unrolled stacks compute the same numbers: the forward (every attention map and
    intermediate, under the same per-layer names and in the same order), the loss and gradients
    with dropout, rematerialised or not, and generate. In float64 within the float64 tolerance:
    XLA fuses across unrolled layers, so the unrolled program's layers after the first differ from
    the scanned ones by a few ulps (the first: the test below)."""
    import numpy as np
    from conformance import init_params
    from conformance.check.compare import assert_close
    from conformance.check.tolerances import tolerance
    from conformance.core.dropout import draw_dropout
    from impl_jax import compiled
    from batches import SRC, TGT, small

    config = small()
    labels = np.where(TGT == config.pad_id, config.pad_id, TGT)
    dropout = draw_dropout(config, *SRC.shape, TGT.shape[1], seed=1)
    with impl_jax.enable_x64():
        model = impl_jax.Model(config, init_params(config, dtype=np.float64), "float64")
        results = {}
        for scan, remat in ((False, False), (True, False), (True, True)):
            with compiled.stacks(scan=scan, remat=remat):
                out = model(SRC, TGT)
                loss, grads = model.loss_and_grads(SRC, TGT, labels, label_smoothing=0.1, dropout=dropout)
                ids = model.generate(SRC[:2], 6, 1, 2, num_beams=2)  # rows with a real token
            results[scan, remat] = out, loss, grads, ids
    reference = results[False, False]
    tol = tolerance("float64", "cpu")
    for setting, (out, loss, grads, ids) in results.items():
        assert list(out.attention) == list(reference[0].attention)  # per-layer names, the loop's order
        assert list(out.intermediates) == list(reference[0].intermediates)
        kwargs = dict(backend="jax", device="cpu", dtype="float64", config=config)
        assert_close(out.logits, reference[0].logits, tol, tensor=f"logits {setting}", **kwargs)
        for name in out.attention:
            assert_close(out.attention[name], reference[0].attention[name], tol, tensor=name, **kwargs)
        for name in out.intermediates:
            assert_close(out.intermediates[name], reference[0].intermediates[name], tol, tensor=name, **kwargs)
        assert_close(np.asarray(loss), np.asarray(reference[1]), tol, tensor="loss", **kwargs)
        for name in grads:
            assert_close(grads[name], reference[2][name], tol, tensor=f"grad {name}", **kwargs)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(reference[3]))


# The first layer of each stack, scanned and unrolled, in float64; prints which intermediates differ.
FIRST_LAYERS = """
import json, numpy as np
import impl_jax
from conformance import init_params
from impl_jax import compiled
from batches import SRC, TGT, small
config = small()
with impl_jax.enable_x64():
    model = impl_jax.Model(config, init_params(config, dtype=np.float64), "float64")
    outs = {}
    for scan in (False, True):
        with compiled.stacks(scan=scan):
            outs[scan] = model(SRC, TGT).intermediates
names = ("encoder.0.self_attn", "encoder.0.ffn", "decoder.0.self_attn")
print(json.dumps([n for n in names if not np.array_equal(np.asarray(outs[False][n]), np.asarray(outs[True][n]))]))
"""


def test_the_first_layer_of_a_stack_is_the_same_program_scanned_or_not():
    """The first layer of each stack is the same program scanned or unrolled: bit for bit, at
    XLA:CPU's own settings. Run in a process of its own without the LLVM level and the loop
    emitters this test run compiles with (tests/xla_emitters.py): the loop emitters write the same
    operations' kernels differently in the two programs (last bits of the first layers differ)."""
    printed = run_with_xla_emitters(FIRST_LAYERS)
    assert json.loads(printed.strip().splitlines()[-1]) == []


def test_scanned_stacks_trace_one_layer():
    """The scanned program holds one copy of each layer: its StableHLO does not grow with depth."""
    import numpy as np
    from conformance import init_params
    from impl_jax import compiled
    from impl_jax.model import Model, padding_mask
    from batches import SRC, small

    sizes = {}
    for layers in (1, 3):
        config = small(n_encoder_layers=layers, n_decoder_layers=layers)
        model = Model(config, init_params(config, dtype=np.float32))
        src = np.asarray(SRC, np.int32)
        for scan in (False, True):
            with compiled.stacks(scan=scan):
                text = compiled.lower(model, Model._encode, (src, padding_mask(src, config.pad_id), None), model.device,
                                      return_attention=False).as_text()
            sizes[layers, scan] = text.count("dot_general")
    assert sizes[3, False] == 3 * sizes[1, False]  # unrolled: a copy per layer
    assert sizes[3, True] == sizes[1, True]  # scanned: one


# -- LayerNorm, one function under differentiation ------------------------------------------------


def largest_fusion_of_the_gradient(config) -> int:
    """Instructions in the largest fused computation of `_loss_and_grads`, as XLA:CPU optimised it."""
    import re

    import numpy as np
    from conformance import init_params
    from impl_jax import compiled
    from impl_jax.model import Model
    from batches import SRC, TGT

    model = Model(config, init_params(config, dtype=np.float32), "float32")
    src, tgt = SRC[:2], TGT[:2]  # the third source row is all padding: NaN under a -inf fill
    args, static = model._loss_args(src, tgt, np.where(tgt == config.pad_id, config.pad_id, 3), 0.1, None)
    text = compiled.lower(model, Model._loss_and_grads, args, model.device, **static).compile().as_text()
    return max(c.count(" = ") for c in re.split(r"\n(?=\S)", text) if c.startswith("%fused"))


@pytest.mark.parametrize("name", ["flax-wmt", "pre-ln-tutorial"])
def test_a_pre_ln_backward_does_not_chain_its_layers_into_one_fusion(name):
    """In a pre-LN stack, x feeds the residual and the norm. Spread out, the norm's parts of x's
    gradient (through x - mean, the mean, x * x) met the residual's one by one, and XLA fused each
    layer's norm backward into every fusion below it: the largest fusion grew with depth (on jax
    0.10.2, flax-wmt: 171 instructions at 1 layer, 543 at 4; the base step's compile 2x slower).
    With LayerNorm one jitted function, its gradient for x is one sum, and the fusions stay a
    layer's (84 and 96)."""
    from batches import small

    sizes = [largest_fusion_of_the_gradient(small(name, n_encoder_layers=n, n_decoder_layers=n)) for n in (1, 4)]
    assert sizes[1] <= 1.25 * sizes[0], f"largest fusion {sizes[0]} instructions at 1 layer, {sizes[1]} at 4"


NORM_AS_ONE_FUNCTION = """
import json, numpy as np
import impl_jax
from impl_jax.model import LayerNorm
from conformance import init_params
from batches import SRC, TGT, small
results = {}
for name in NAMES:  # the norm forms and placements the test asks for
    config = small(name, n_encoder_layers=1, n_decoder_layers=1)
    params = init_params(config, dtype=np.float32)
    src, tgt = SRC[:2], TGT[:2]  # the third source row is all padding: NaN under a -inf fill
    labels = np.where(tgt == config.pad_id, config.pad_id, 3)
    outs = []
    for jitted in (True, False):
        if not jitted:  # the norm written out inline; the executables of the jitted one dropped
            LayerNorm.__call__ = LayerNorm.__call__.__wrapped__
            impl_jax.compiled.clear_cache()
        model = impl_jax.Model(config, params, "float32")
        out = model(SRC, TGT)
        loss, grads = model.loss_and_grads(src, tgt, labels)
        outs.append(({**out.intermediates, **out.attention, "logits": out.logits}, grads))
        if not jitted:
            LayerNorm.__call__ = impl_jax.model.jax.jit(LayerNorm.__call__)
            impl_jax.compiled.clear_cache()
    (fwd, grads), (fwd0, grads0) = outs
    results[name] = {
        "forward": [k for k in fwd if not np.array_equal(np.asarray(fwd[k]), np.asarray(fwd0[k]), equal_nan=True)],
        "gradients changed": [k for k in grads if not np.array_equal(np.asarray(grads[k]), np.asarray(grads0[k]))],
        # against the largest gradient entry of all: a key bias's gradient is zero in exact
        # arithmetic (softmax ignores a shift of every score), rounding noise in either order
        "gradient": max(float(np.max(np.abs(np.asarray(grads[k]) - np.asarray(grads0[k])))) for k in grads)
                    / max(float(np.max(np.abs(np.asarray(g)))) for g in grads0.values()),
    }
print(json.dumps(results))
"""


def test_layer_norm_as_one_function_keeps_the_forward_bit_for_bit():
    """The nested jit is inlined by XLA: every tensor of the forward is what the norm written out
    inline gives, bit for bit (XLA:CPU's own settings, tests/xla_emitters.py). Post-LN gradients
    are the same bit for bit; pre-LN ones differ only where the sum's order does, by float32
    rounding (here at most 5e-8 of the largest gradient entry of any tensor; on the base size at
    most 1.4e-6 of a tensor's own largest entry)."""
    # Three norm forms (pre-LN) and post-LN: 24 compiles at XLA's own settings, 53 CPU-seconds.
    # Under `ci` one form of each placement (fast-variance pre-LN, standard post-LN); `thorough`
    # adds pre-LN's standard and std-eps forms.
    names = ci_or_every(("flax-wmt", "pre-ln-tutorial", "annotated-transformer", "default"), ci=("flax-wmt", "default"))
    program = NORM_AS_ONE_FUNCTION.replace("NAMES", repr(names))
    results = json.loads(run_with_xla_emitters(program).strip().splitlines()[-1])
    assert list(results) == list(names)
    for name, result in results.items():
        assert result["forward"] == [], f"{name}: these tensors changed: {result['forward']}"
        assert result["gradient"] <= 1e-6, f"{name}: gradients moved by {result['gradient']:.2e} of the largest entry"
    assert results["default"]["gradients changed"] == [], "post-LN: the norm's gradient was one term already"


# -- Matmul precision, a choice of the model ------------------------------------------------------


def test_precision_is_a_checked_choice_of_the_model():
    import numpy as np
    from conformance import InputError, init_params
    from impl_jax.model import Model, padding_mask
    from impl_jax import compiled
    from batches import SRC, TGT, small

    config = small()
    params = init_params(config, dtype=np.float32)
    with pytest.raises(InputError, match="precision"):
        impl_jax.Model(config, params, precision="tf32")
    highest, default = impl_jax.Model(config, params), impl_jax.Model(config, params, precision="default")
    assert highest.precision == "highest"
    src = np.asarray(SRC, np.int32)
    for model, expected in ((highest, "HIGHEST"), (default, "DEFAULT")):
        text = compiled.lower(model, Model._encode, (src, padding_mask(src, config.pad_id), None), model.device,
                              return_attention=False).as_text()
        # StableHLO names the precision of every dot_general (HIGHEST), or omits it at DEFAULT.
        marked = text.count(f"precision = [HIGHEST, HIGHEST]") if expected == "HIGHEST" else 0
        if expected == "HIGHEST":
            assert marked == text.count("dot_general") > 0, text[:2000]
        else:
            assert "HIGHEST" not in text
    # On a CPU, XLA computes float32 matmuls in full float32 at either precision.
    a, b = highest(SRC, TGT), default(SRC, TGT)
    assert np.array_equal(np.asarray(a.logits), np.asarray(b.logits))


# -- The fused training step ---------------------------------------------------------------------


def fused_and_plain():
    """Two float64 models of tests/batches' small config from the same weights, each with an
    impl_jax.Adam, and the labels of TGT (call inside `impl_jax.enable_x64()`)."""
    import numpy as np
    from conformance import init_params
    from batches import TGT, small

    config = small()
    params = init_params(config, dtype=np.float64)
    fused, plain = impl_jax.Model(config, params, "float64"), impl_jax.Model(config, params, "float64")
    optimizers = (impl_jax.Adam(fused, config.d_model, warmup=10), impl_jax.Adam(plain, config.d_model, warmup=10))
    return config, np.where(TGT == config.pad_id, config.pad_id, TGT), (fused, plain), optimizers


# The two fused-step tests compile the same float64 step and the same unfused loss_and_grads +
# Adam (tests/batches' small config): on one xdist worker the second reuses the first's programs
# (measured, whole pytest processes of which collection is 3.2 CPU-s: apart 10.9 + 19.0, together 20.2).
FUSED_STEP_GROUP = pytest.mark.xdist_group("jax-fused-step")


@FUSED_STEP_GROUP
def test_fused_train_step_is_loss_and_grads_then_adam_and_donates():
    """impl_jax.train_step with impl_jax.Adam: one compiled step, bit for bit the core's
    loss_and_grads + Adam.step in float64, with the old parameter buffers donated (deleted)."""
    import numpy as np
    from conformance.core import training
    from batches import SRC, TGT

    with impl_jax.enable_x64():
        _, labels, (fused, plain), (fused_opt, plain_opt) = fused_and_plain()
        for _ in range(2):
            old = fused.params["encoder.layers.0.ffn.linear1.weight"]
            loss = impl_jax.train_step(fused, fused_opt, SRC, TGT, labels, label_smoothing=0.1)
            assert old.is_deleted()  # donated: XLA wrote the new values into its buffer
            expected = training.train_step(plain, plain_opt, SRC, TGT, labels, label_smoothing=0.1)
            assert float(loss) == float(expected)
        assert fused_opt.steps == plain_opt.steps == 2
        for name, value in fused.params.items():
            np.testing.assert_array_equal(np.asarray(value), np.asarray(plain.params[name]), err_msg=name)


@FUSED_STEP_GROUP
def test_fused_train_step_follows_the_model_between_steps():
    """The fused step reads the model's structure and variables afresh at every step
    (impl_jax/train.py's StepLayout, a tree flatten instead of nnx.split): new values through
    nnx.update, a variable replaced by another and a changed static attribute (the matmul
    precision) are all stepped as the unfused loss_and_grads + Adam.step steps them, and an
    unchanged model reuses its layout without compiling again."""
    import numpy as np
    from flax import nnx

    from conformance.core import training
    from impl_jax.train import step_layout
    from batches import SRC, TGT

    with impl_jax.enable_x64():
        config, labels, (fused, plain), (fused_opt, plain_opt) = fused_and_plain()

        def step_both(what: str) -> None:
            loss = impl_jax.train_step(fused, fused_opt, SRC, TGT, labels, label_smoothing=0.1)
            expected = training.train_step(plain, plain_opt, SRC, TGT, labels, label_smoothing=0.1)
            assert float(loss) == float(expected), what
            for name, value in fused.params.items():
                np.testing.assert_array_equal(np.asarray(value), np.asarray(plain.params[name]), err_msg=f"{what}: {name}")

        step_both("first step")
        layout = step_layout(fused)[1]
        compiles = impl_jax.compile_stats()["compiles"]
        step_both("unchanged")
        assert step_layout(fused)[1] is layout and impl_jax.compile_stats()["compiles"] == compiles

        bias = np.linspace(-0.5, 0.5, config.tgt_vocab_size)
        for model in (fused, plain):  # new values in the same variable
            nnx.update(model, nnx.from_flat_state([(("output", "bias"), jax.numpy.asarray(bias))]))
        step_both("nnx.update")
        for model in (fused, plain):  # another variable object in its place
            model.output.bias = nnx.Param(jax.numpy.asarray(bias[::-1].copy()))
        replaced = fused.output.bias
        step_both("a replaced variable")
        assert replaced is fused.output.bias and np.array_equal(np.asarray(replaced[...]), np.asarray(plain.output.bias[...]))
        assert not np.array_equal(np.asarray(replaced[...]), bias[::-1])  # the new variable was stepped

        compiles = impl_jax.compile_stats()["compiles"]
        for model in (fused, plain):  # a static attribute: another program
            model.precision = "default"
        step_both("precision default")
        assert step_layout(fused)[1] is not layout
        assert impl_jax.compile_stats()["compiles"] > compiles


def test_step_layout_tells_a_variable_shared_by_two_places_from_two_variables():
    """A tree's structure cannot say that two of its places hold one variable (nnx.split can): the
    fused step's layout is keyed by the sharing too, so a model whose decoder reads the encoder's
    embedding module never takes the layout of one with two embeddings (whose parameter list would
    hold the shared array twice). And gradients that are weakly typed JAX arrays are made strong
    before the update (a weak type is a separate jit key: another compile)."""
    import numpy as np

    from conformance import init_params
    from impl_jax.train import _as_array, step_layout
    from batches import small

    config = small()
    params = init_params(config, dtype=np.float32)
    apart, shared = impl_jax.Model(config, params, "float32"), impl_jax.Model(config, params, "float32")
    _, layout = step_layout(apart)
    shared.decoder.embedding = shared.encoder.embedding  # one module, reached from two places
    assert jax.tree.structure(shared) == jax.tree.structure(apart)  # the tree alone cannot tell
    variables, shared_layout = step_layout(shared)
    assert shared_layout != layout
    assert len(shared_layout.param_paths) == len(layout.param_paths) - 1
    assert len({id(v) for v in variables}) == len(variables) - 1
    assert step_layout(apart)[1] is layout  # and the model apart keeps its own

    weak = jax.numpy.full((3,), 1.0)
    assert weak.weak_type and not _as_array(weak, np.float32).weak_type
    strong = jax.numpy.ones((3,), np.float32)
    assert _as_array(strong, np.float32) is strong


def test_triton_products_are_chosen_by_platform_dtype_and_setting(monkeypatch):
    """On a GPU, float32 and float64 programs are compiled without Triton products (cuBLAS), other
    dtypes with XLA's default; elsewhere the option is never set; TRITON_GEMM overrides; a value
    that means nothing is refused by name."""
    from impl_jax import compiled

    triton = compiled.triton_gemm
    assert not triton("gpu", "float32") and not triton("gpu", "float64")
    assert triton("gpu", "bfloat16") and triton("gpu", "float16") and triton("cpu", "float32")
    monkeypatch.setattr(compiled, "TRITON_GEMM", "1")
    assert triton("gpu", "float32")
    monkeypatch.setattr(compiled, "TRITON_GEMM", "0")
    assert not triton("gpu", "bfloat16") and triton("cpu", "float32")
    monkeypatch.setattr(compiled, "TRITON_GEMM", "sometimes")
    with pytest.raises(ValueError, match="ROSETTA_JAX_TRITON_GEMM.*'sometimes'.*auto, 1 or 0"):
        triton("gpu", "float32")


def test_programs_compiled_without_triton_products_give_the_same_numbers(monkeypatch):
    """The jits that carry XLA's `xla_gpu_enable_triton_gemm=False` (forced here on the CPU, where
    the option changes nothing) are the ones called, they compile, and the forward pass and the
    fused training step give the default jits' numbers bit for bit."""
    import numpy as np
    from conformance import init_params
    from batches import SRC, TGT, small
    from impl_jax import compiled

    config = small(d_ff=20)  # a config only this test compiles
    params = init_params(config, dtype=np.float32)
    labels = np.where(TGT == config.pad_id, config.pad_id, TGT)

    def run():
        model = impl_jax.Model(config, params, "float32")
        optimizer = impl_jax.Adam(model, config.d_model, warmup=10)
        logits = np.asarray(model(SRC, TGT, return_attention=False).logits)
        loss = float(impl_jax.train_step(model, optimizer, SRC, TGT, labels, label_smoothing=0.1))
        return logits, loss, {name: np.asarray(value) for name, value in model.params.items()}

    want = run()
    monkeypatch.setattr(compiled, "triton_gemm", lambda platform, dtype: False)
    sizes = {key: jit._cache_size() for key, jit in compiled._JITS.items()}
    got = run()
    assert compiled._JITS[(False, False)]._cache_size() > sizes[(False, False)]  # the forward's programs
    assert compiled._JITS[(True, False)]._cache_size() > sizes[(True, False)]  # the fused, donating step
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1]
    for name in want[2]:
        np.testing.assert_array_equal(got[2][name], want[2][name], err_msg=name)
