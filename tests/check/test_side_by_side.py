"""`conformance.compare`: each re-created system (tests/systems/) beside ours, through its built-in
layout's [taps].

- clean, float32: the user's column and every backend's agree with the oracle (no divergence;
  JAX beside two systems, see WITH_JAX);
- planted bugs, float64 (the user's model `.double()`, the oracle alone: no backend compile):
  a wrong LayerNorm epsilon in one layer, a missing (or extra) embedding scale, a source mask that
  ignores padding, a swapped sin/cos; each is found at the first tensor it touches, and the report
  names the switch that would explain it;
- grads=True, float64: the loss and every gradient agree with the system's own autograd
  (`jax.grad` for Flax), and a gradient scaled by 1.5 on one parameter is found on that parameter.

One tiny config per system (the converter tests' sizes); the JAX backend compiles once per
system, in the clean test only.
"""

from __future__ import annotations

import copy
import re
import functools
import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the re-created systems are PyTorch modules")

import conformance  # noqa: E402
from conformance.check.switches import switches_at  # noqa: E402
from systems import annotated, from_scratch, hyunwoongko, llmhub, pre_ln_tutorial, randomize_, sublayer_norm, torch_tutorial  # noqa: E402
from systems.harness import BACKENDS, padded_batch  # noqa: E402
from conformance.check import backends as backend_registry  # noqa: E402

SIZES = dict(src_vocab=23, tgt_vocab=19, d_model=32, n_heads=4, d_ff=48, n_layers=2, max_len=40)
MARIAN_VOCAB = 19
MARIAN_PAD = MARIAN_VOCAB - 1  # opus-mt puts <pad> last


def _marian():
    transformers = pytest.importorskip("transformers", reason="the hf-marian system is a transformers MarianMTModel")
    config = transformers.MarianConfig(
        vocab_size=19, decoder_vocab_size=19, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=40,
        pad_token_id=MARIAN_PAD, decoder_start_token_id=MARIAN_PAD, eos_token_id=0, forced_eos_token_id=0,
        activation_function="swish", scale_embedding=True, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config).eval()
    return randomize_(model, 3, buffers=("final_logits_bias",), skip=("embed_positions",))


def _marian_run(model, src, tgt):
    return model(input_ids=src, attention_mask=(src != MARIAN_PAD).long(), decoder_input_ids=tgt,
                 output_attentions=True).logits


# layout -> (make the model, overrides for the conversion, run, pad id)
TORCH_SYSTEMS = {
    "from-scratch": (lambda: from_scratch.make(**SIZES), {}, None, from_scratch.PAD),
    "llmhub": (lambda: llmhub.make(**SIZES), {}, None, llmhub.PAD),
    "hyunwoongko": (lambda: hyunwoongko.make(**SIZES), {"max_len": SIZES["max_len"]}, None, hyunwoongko.PAD),
    "sublayer-norm": (lambda: sublayer_norm.make(**SIZES), {}, None, sublayer_norm.PAD),
    "pre-ln-tutorial": (lambda: pre_ln_tutorial.make(**SIZES), {}, None, pre_ln_tutorial.PAD),
    "annotated-transformer": (lambda: annotated.make(**SIZES), {"pad_id": annotated.PAD}, annotated.logits, annotated.PAD),
    "torch-nn-transformer": (lambda: torch_tutorial.make(**SIZES), {"norm_placement": "post", "pad_id": torch_tutorial.PAD},
                             torch_tutorial.logits, torch_tutorial.PAD),
    "hf-marian": (_marian, {"pad_id": MARIAN_PAD, "activation": "silu"}, _marian_run, MARIAN_PAD),
}

# Where each planted bug goes: (module path, ...) per system.
# A LayerNorm of encoder layer 1 that closes (post-LN) or opens (pre-LN) its feed-forward sublayer.
EPS_NORM = {
    "from-scratch": "encoder.layers.1.norm2", "llmhub": "encoder.layers.1.norm2", "hyunwoongko": "encoder.layers.1.norm2",
    "sublayer-norm": "encoder.1.ffn.layer_norm", "pre-ln-tutorial": "encoder_layers.1.layernorm.1",
    "annotated-transformer": "encoder.layers.1.sublayer.1.norm", "torch-nn-transformer": "transformer.encoder.layers.1.norm2",
    "hf-marian": "model.encoder.layers.1.final_layer_norm",
}
# The source token embedding, and whether the system scales it by sqrt(d_model).
TOKEN_EMBEDDING = {
    "from-scratch": ("encoder_embedding", True), "llmhub": ("encoder.embedding", True),
    "hyunwoongko": ("encoder.emb.tok_emb", False), "sublayer-norm": ("src_embed", False),
    "pre-ln-tutorial": ("src_embed", True), "annotated-transformer": ("src_embed.0", True),
    "torch-nn-transformer": ("src_tok_emb", True), "hf-marian": ("model.encoder.embed_tokens", True),
}
# Encoder layer 0's self-attention (or the layer, which hands the mask on) and where its mask goes.
SOURCE_MASK = {
    "from-scratch": ("encoder.layers.0.self_attn", 3), "llmhub": ("encoder.layers.0.self_attn", 3),
    "hyunwoongko": ("encoder.layers.0.attention", "mask"), "sublayer-norm": ("encoder.0.self_attn", 2),
    "pre-ln-tutorial": ("encoder_layers.0.self_attn", 3), "annotated-transformer": ("encoder.layers.0.self_attn", 3),
    "torch-nn-transformer": ("transformer.encoder.layers.0", "src_key_padding_mask"),
    "hf-marian": ("model.encoder.layers.0", 1),
}
# The source position module: whether it returns x + table or the table, and the sinusoid's form.
POSITIONS = {
    "from-scratch": ("positional_encoding", "adds", "interleaved"), "llmhub": ("encoder.pos_encoding", "adds", "interleaved"),
    "hyunwoongko": ("encoder.emb.pos_emb", "returns", "interleaved"), "sublayer-norm": ("pos_encoder", "adds", "interleaved"),
    "pre-ln-tutorial": ("pos_enc", "adds", "interleaved"), "annotated-transformer": ("src_embed.1", "adds", "interleaved"),
    "torch-nn-transformer": ("positional_encoding", "adds", "interleaved"),
    "hf-marian": ("model.encoder.embed_positions", "returns", "split"),
}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nn.Transformer's mask and nested-tensor notes
        yield


@functools.cache
def system(name: str):
    make, _, _, _ = TORCH_SYSTEMS[name]
    return randomize_(make(), 1) if name != "hf-marian" else make()


def float64(name: str):
    """A float64 copy of a system. hyunwoongko keeps its sinusoid a float32 attribute whatever
    `.double()` does; the copy gets it computed in float64, as the system computes it."""
    model = copy.deepcopy(system(name)).double()
    if name == "hyunwoongko":
        for stack in (model.encoder, model.decoder):
            table = stack.emb.pos_emb.encoding
            pos = torch.arange(table.shape[0], dtype=torch.float64)[:, None]
            two_i = torch.arange(0, table.shape[1], 2, dtype=torch.float64)
            table = torch.zeros(table.shape, dtype=torch.float64)
            table[:, 0::2] = torch.sin(pos / 10000 ** (two_i / table.shape[1]))
            table[:, 1::2] = torch.cos(pos / 10000 ** (two_i / table.shape[1]))
            stack.emb.pos_emb.encoding = table
    return model


def batch(name: str):
    pad = TORCH_SYSTEMS[name][3]
    if name == "hf-marian":  # one vocabulary for both sides
        return padded_batch(pad, MARIAN_VOCAB, MARIAN_VOCAB)
    return padded_batch(pad, SIZES["src_vocab"], SIZES["tgt_vocab"])


def labels_for(name: str, tgt: np.ndarray) -> np.ndarray:
    pad = TORCH_SYSTEMS[name][3]
    nxt = np.roll(tgt, -1, axis=1)
    nxt[:, -1] = pad
    return np.where(tgt == pad, pad, nxt)


def run_compare(name: str, model, **options):
    _, overrides, run, _ = TORCH_SYSTEMS[name]
    src, tgt = batch(name)
    return conformance.compare(model, name, src, tgt, run=run, n_heads=SIZES["n_heads"], **overrides, **options)


def installed_backends() -> list[str]:
    return [b for b in BACKENDS if backend_registry.availability([b])[b] is None]


# -- clean ----------------------------------------------------------------------------------------


# The JAX backend compiles once per config (10 s each on the CI machine): it runs beside one torch
# system here (and the Flax one below); tests/convert/test_source_systems.py runs it on every system's
# config against the system's logits.
WITH_JAX = {"from-scratch"}


@pytest.mark.parametrize("name", TORCH_SYSTEMS)
def test_a_clean_system_agrees_everywhere_in_every_backend(name):
    chosen = [b for b in installed_backends() if b != "jax" or name in WITH_JAX]
    report = run_compare(name, system(name), backends=chosen)
    assert report.first_divergence is None, str(report)
    assert report.ok, str(report)
    labels = [t.label for t in report.targets]
    assert labels[0] == "yours/cpu/float32" and len(labels) == 1 + len(chosen)
    exposed = [t for t in report.tensors if report.cells[(t, labels[0])].unavailable is None]
    # Every sublayer's residual output and the logits are read from the system itself.
    assert {"encoder.embeddings", "encoder.1.ffn", "encoder.output", "decoder.1.cross_attn", "decoder.output",
            "logits"} <= set(exposed), str(report)
    text = str(report)
    assert "first divergence: none" in text and "not exposed" in text.split("result:")[0] or len(exposed) == len(report.tensors)


def test_attention_weights_are_read_where_the_system_keeps_them():
    """The Annotated Transformer keeps `self.attn`; Marian returns its weights with output_attentions."""
    for name in ("annotated-transformer", "hf-marian"):
        report = run_compare(name, float64(name), backends=())
        cell = report.cells[("decoder.1.cross", "yours/cpu/float64")]
        assert cell.unavailable is None and cell.passed, (name, str(report))


def test_a_tensor_the_system_does_not_give_is_not_exposed_not_guessed():
    report = run_compare("from-scratch", float64("from-scratch"), backends=())
    cell = report.cells[("encoder.0.self", "yours/cpu/float64")]
    assert cell.unavailable and cell.comparison is None
    assert "encoder.0.self" in report.to_json()["not_exposed"]
    assert "not exposed" in str(report)


def test_the_report_as_a_table_json_and_a_picture(tmp_path):
    """str(report) is the check table with the user's model as its first column beside our
    backends; to_json() is plain JSON; plot() draws every column (a PNG)."""
    import json

    model = float64("from-scratch")
    modules(model)["encoder.layers.1.norm2"].eps = 1e-12
    report = run_compare("from-scratch", model, backends=["numpy"])
    header = next(line for line in str(report).splitlines() if line.startswith("tensor "))
    assert header.split()[1:] == ["yours/cpu/float64", "numpy/cpu/float32"], header
    row = next(line for line in str(report).splitlines() if line.startswith("encoder.1.ffn "))
    assert row.split()[3] == "FAIL" and row.split()[-1] == "ok", row  # yours diverges there, our backend does not
    data = json.loads(json.dumps(report.to_json()))
    assert data["first_divergence"] == "encoder.1.ffn" and data["yours"] == "yours/cpu/float64" and not data["ok"]
    assert "layer_norm_eps" in data["switches_at_divergence"] and data["layout"] == "from-scratch"
    assert [t["label"] for t in data["targets"]] == ["yours/cpu/float64", "numpy/cpu/float32"]
    width, height = report.plot(tmp_path / "compare.png")
    assert width > 0 and height > 0 and (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- planted bugs (float64, the oracle alone) ---------------------------------------------------


def modules(model) -> dict:
    return dict(model.named_modules(remove_duplicate=False))


def first_exposed(report, *tensors: str) -> str:
    return next(t for t in tensors if report.cells[(t, report.yours.label)].unavailable is None)


def assert_found(report, expected: str, switch: str):
    __tracebackhide__ = True
    assert report.first_divergence == expected, str(report)
    assert switch in switches_at(expected)
    text = str(report)
    assert f"first divergence: {expected}" in text and switch in text.split("first divergence:")[-1], text
    assert f"rosetta layouts {report.layout}" in text
    assert report.to_json()["first_divergence"] == expected and not report.ok


@pytest.mark.parametrize("name", TORCH_SYSTEMS)
def test_a_wrong_layer_norm_epsilon_is_found_at_its_layer(name):
    model = float64(name)
    norm = modules(model)[EPS_NORM[name]]
    norm.eps = 1e-12 if norm.eps != 1e-12 else 1e-5
    assert_found(run_compare(name, model, backends=()), "encoder.1.ffn", "layer_norm_eps")


@pytest.mark.parametrize("name", TORCH_SYSTEMS)
def test_a_missing_embedding_scale_is_found_at_the_embeddings(name):
    model = float64(name)
    path, scaled = TOKEN_EMBEDDING[name]
    factor = math.sqrt(SIZES["d_model"])
    # Scaled systems lose their scale; unscaled ones gain one: either way scale_embedding.
    modules(model)[path].register_forward_hook(lambda m, a, out: out / factor if scaled else out * factor)
    assert_found(run_compare(name, model, backends=()), "encoder.embeddings", "scale_embedding")


@pytest.mark.parametrize("name", TORCH_SYSTEMS)
def test_a_mask_that_ignores_padding_is_found_at_the_first_attention(name):
    model = float64(name)
    path, where = SOURCE_MASK[name]

    def unmask(module, args, kwargs):
        if isinstance(where, str) or where >= len(args):
            key = where if isinstance(where, str) else "attention_mask"
            return args, {**kwargs, key: None}
        return (*args[:where], None, *args[where + 1:]), kwargs

    modules(model)[path].register_forward_pre_hook(unmask, with_kwargs=True)
    report = run_compare(name, model, backends=())
    assert_found(report, first_exposed(report, "encoder.0.self", "encoder.0.self_attn"), "src_pad_mask")


def swapped(table, form: str):
    """sin and cos exchanged: even and odd features (interleaved), or the two halves (split)."""
    out = table.clone()
    if form == "interleaved":
        out[..., 0::2], out[..., 1::2] = table[..., 1::2], table[..., 0::2]
    else:
        half = table.shape[-1] // 2
        out[..., :half], out[..., half:] = table[..., half:], table[..., :half]
    return out


@pytest.mark.parametrize("name", TORCH_SYSTEMS)
def test_a_swapped_sin_cos_is_found_at_the_embeddings(name):
    model = float64(name)
    path, kind, form = POSITIONS[name]

    def swap(module, args, out):
        return swapped(out, form) if kind == "returns" else args[0] + swapped(out - args[0], form)

    modules(model)[path].register_forward_hook(swap)
    assert_found(run_compare(name, model, backends=()), "encoder.embeddings", "position")


# -- backward ---------------------------------------------------------------------------------------


def grad_key(name: str, model) -> str:
    """The first feed-forward weight of encoder layer 0, under the system's own key."""
    keys = [k for k, _ in model.named_parameters() if ".0." in k and "encoder" in k and "weight" in k
            and any(w in k for w in ("linear1", "w_1", "fc1", "linear1"))]
    assert keys, name
    return keys[0]


@pytest.mark.parametrize("name", TORCH_SYSTEMS)
def test_gradients_agree_with_the_systems_autograd(name):
    model = float64(name)
    src, tgt = batch(name)
    report = run_compare(name, model, backends=(), grads=True, labels=labels_for(name, tgt), label_smoothing=0.1)
    assert report.first_divergence is None and report.ok, str(report)
    trained = [k for k, p in model.named_parameters() if p.requires_grad]  # Marian's sinusoid is frozen
    assert sorted(row.key for row in report.grads) == sorted(trained), str(report)
    # Backward order: the logits' parameters first, the source embedding last.
    assert report.grads[-1].canonical == ("encoder.embedding.weight",) or report.grads[-1].canonical[0].startswith("encoder.")


@pytest.mark.parametrize("name", TORCH_SYSTEMS)
def test_a_planted_gradient_bug_is_found_on_its_parameter(name):
    model = float64(name)
    key = grad_key(name, model)
    dict(model.named_parameters())[key].register_hook(lambda g: g * 1.5)
    src, tgt = batch(name)
    report = run_compare(name, model, backends=(), grads=True, labels=labels_for(name, tgt))
    assert report.first_divergence is None, str(report)
    assert report.first_bad_grad == key and not report.ok, str(report)
    assert [row.key for row in report.grads if not row.passed] == [key]
    assert f"first gradient out of tolerance: {key}" in str(report)
    assert report.to_json()["backward"]["first_bad_grad"] == key


# -- Flax examples/wmt (linen) ------------------------------------------------------------------------


def wmt_system(dtype: str):
    """(wmt module, its config, bound model, src, targets) in float32 or float64 (x64 on for the latter)."""
    pytest.importorskip("flax", reason="the flax-wmt system is a flax.linen model")
    import jax
    import jax.numpy as jnp
    from systems import flax_wmt as wmt

    c = wmt.WmtConfig(vocab_size=19, output_vocab_size=23, dtype=jnp.float64 if dtype == "float64" else jnp.float32,
                      emb_dim=32, num_heads=4, qkv_dim=32, mlp_dim=48, num_layers=2, max_len=12)
    params = wmt.init(c, seed=1)
    if dtype == "float64":
        params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)
    src, tgt = padded_batch(0, c.vocab_size, c.output_vocab_size, seed=3)
    return wmt, c, (wmt.Transformer(c), {"params": params}), src, tgt


def wmt_compare(model, src, tgt, **options):
    return conformance.compare(model, "flax-wmt", src, tgt, max_len=12, **options)


def intercepted(path: str, replace):
    """A run that calls the model with the module at `path` replaced: `replace(next_fun, args, kwargs, module)`."""
    from flax import linen as nn
    from conformance.check.foreign.taps import linen_path

    def run(model, src, tgt):
        def interceptor(next_fun, args, kwargs, context):
            if context.method_name == "__call__" and linen_path(context.module) == path:
                return replace(next_fun, args, kwargs, context.module)
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(interceptor):
            return model(src, tgt)
    return run


def test_flax_wmt_clean_agrees_everywhere():
    _, _, model, src, tgt = wmt_system("float32")
    report = wmt_compare(model, src, tgt, backends=installed_backends())
    assert report.first_divergence is None and report.ok, str(report)
    exposed = [t for t in report.tensors if report.cells[(t, "yours/cpu/float32")].unavailable is None]
    assert {"encoder.embeddings", "encoder.0.self_attn", "encoder.1.ffn", "encoder.output", "decoder.embeddings",
            "decoder.1.cross_attn", "decoder.output", "logits"} <= set(exposed), str(report)


def test_flax_wmt_planted_bugs_are_found():
    import jax.numpy as jnp

    wmt, c, model, src, tgt = wmt_system("float64")
    # Each planted bug is found at its tensor, so every tensor before it agrees in float64.

    def wrong_eps(next_fun, args, kwargs, module):  # wmt's fast-variance LayerNorm at eps 1e-5 instead of 1e-6
        x, p = args[0], module.variables["params"]
        mean = x.mean(-1, keepdims=True)
        var = (x * x).mean(-1, keepdims=True) - mean * mean
        return (x - mean) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"]

    report = wmt_compare(model, src, tgt, backends=(), run=intercepted("encoder.encoderblock_1.LayerNorm_1", wrong_eps))
    assert_found(report, "encoder.1.ffn", "layer_norm_eps")

    scaled = intercepted("encoder.Embed_0", lambda f, a, k, m: f(*a, **k) * np.sqrt(c.emb_dim))
    assert_found(wmt_compare(model, src, tgt, backends=(), run=scaled), "encoder.embeddings", "scale_embedding")

    unmasked = intercepted("encoder.encoderblock_0.MultiHeadDotProductAttention_0",
                           lambda f, a, k, m: f(*a, **{**k, "mask": None}))
    assert_found(wmt_compare(model, src, tgt, backends=(), run=unmasked), "encoder.0.self_attn", "src_pad_mask")


def test_flax_wmt_swapped_sin_cos_is_found_at_the_embeddings(monkeypatch):
    wmt, c, model, src, tgt = wmt_system("float64")
    original = wmt.sinusoid_table

    def swapped_table(max_len, d):
        table = original(max_len, d)
        return np.concatenate([table[..., d // 2:], table[..., : d // 2]], axis=-1)

    monkeypatch.setattr(wmt, "sinusoid_table", swapped_table)
    assert_found(wmt_compare(model, src, tgt, backends=()), "encoder.embeddings", "position")


def test_flax_wmt_gradients_agree_with_jax_grad_and_a_planted_bug_is_found():
    import jax

    wmt, c, model, src, tgt = wmt_system("float64")
    labels = np.where(tgt > 0, tgt, 0)  # wmt's loss: the targets themselves, padding (0) not counted
    # One run (a backward pass compiles for 13 s): every gradient but the planted one, and the
    # loss, agree with jax.grad; the planted one alone is out.

    @jax.custom_vjp
    def scaled_grad(x):
        return x

    scaled_grad.defvjp(lambda x: (x, None), lambda _, g: (1.5 * g,))

    def buggy(bound, src_ids, tgt_ids):
        module, variables = bound.unbind()
        params = jax.tree_util.tree_map(lambda x: x, dict(variables["params"]))
        dense = dict(params["decoder"]["encoderdecoderblock_1"]["MlpBlock_0"]["Dense_0"])
        dense["kernel"] = scaled_grad(dense["kernel"])
        params["decoder"] = {**params["decoder"], "encoderdecoderblock_1": {
            **params["decoder"]["encoderdecoderblock_1"], "MlpBlock_0": {
                **params["decoder"]["encoderdecoderblock_1"]["MlpBlock_0"], "Dense_0": dense}}}
        return module.apply({"params": params}, src_ids, tgt_ids)

    report = wmt_compare(model, src, tgt, backends=(), grads=True, labels=labels, run=buggy, label_smoothing=0.1)
    key = "decoder.encoderdecoderblock_1.MlpBlock_0.Dense_0.kernel"
    assert report.first_divergence is None and report.first_bad_grad == key, str(report)
    assert [row.key for row in report.grads if not row.passed] == [key]
    assert len(report.grads) == len(jax.tree_util.tree_leaves(model[1]["params"]))
    assert report.loss_error <= report.loss_allowed
    assert max(row.error for row in report.grads if row.key != key) < 1e-13  # float64 against float64


# -- rosetta compare ------------------------------------------------------------------------------------

USER_FILE = '''
import math, torch
from torch import nn

PAD = 0


class Tiny(nn.Module):
    """The from-scratch tutorial's structure, written by a user."""

    def __init__(self, eps=1e-5):
        super().__init__()
        import sys
        sys.path.insert(0, {tests!r})
        from systems import from_scratch
        self.inner = from_scratch.make(src_vocab=23, tgt_vocab=19, d_model=32, n_heads=4, d_ff=48, n_layers=2, max_len=40)
        self.inner.encoder.layers[1].norm2.eps = eps

    def forward(self, src, tgt):
        return self.inner(src, tgt)


def build():
    return Tiny().inner


def build_buggy():
    return Tiny(eps=1e-12).inner


def build_broken():
    raise ValueError("no such checkpoint")


def build_not_a_model():
    return {"weights": None}
'''


def rosetta(capsys, *argv: str):
    """`rosetta ARGV` in this process (the subprocess test below runs the real command once)."""
    from conformance.cli import main

    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def user_file(tmp_path) -> str:
    from pathlib import Path

    tests = str(Path(__file__).resolve().parents[1])
    path = tmp_path / "user_model.py"
    path.write_text(USER_FILE.replace("{tests!r}", repr(tests)) + """

def build_double():
    return Tiny(eps=1e-12).inner.double()
""")
    return str(path)


def test_rosetta_compare_from_the_command_line(tmp_path):
    import json
    import subprocess
    import sys

    user = user_file(tmp_path)
    weights = tmp_path / "weights.pt"
    torch.save(system("from-scratch").state_dict(), weights)
    done = subprocess.run([sys.executable, "-m", "conformance.cli", "compare", f"{user}:build", str(weights), "--layout",
                           "from-scratch", "--set", "n_heads=4", "--backends", "numpy", "--json", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "first divergence: none" in done.stdout and "yours/cpu/float32" in done.stdout
    assert json.loads((tmp_path / "r.json").read_text())["first_divergence"] is None


def test_rosetta_compare_exit_codes_and_one_line_errors(tmp_path, capsys):
    from conformance.cli import build_parser

    user = user_file(tmp_path)
    weights = tmp_path / "weights.pt"
    torch.save(system("from-scratch").state_dict(), weights)
    common = ["--layout", "from-scratch", "--set", "n_heads=4", "--backends", "none"]
    code, out, err = rosetta(capsys, "compare", f"{user}:build", str(weights), *common, "--src", "1,2,3,0;4,5,0,0",
                             "--tgt", "6,7,0;8,0,0")
    assert code == 0 and "first divergence: none" in out, out + err

    # A wrong epsilon in float64 (float32 rounding can hide it, docs/tolerances.md): exit 1, named.
    torch.save(float64("from-scratch").state_dict(), tmp_path / "weights64.pt")
    code, out, err = rosetta(capsys, "compare", f"{user}:build_double", str(tmp_path / "weights64.pt"), *common,
                             "--plot", str(tmp_path / "r.png"))
    assert code == 1, out + err
    assert "first divergence: encoder.1.ffn" in out and "layer_norm_eps" in out and (tmp_path / "r.png").stat().st_size

    # A factory that raises: exit 2, one line, then its own frames (none of ours).
    code, out, err = rosetta(capsys, "compare", f"{user}:build_broken", str(weights), *common)
    assert code == 2 and err.splitlines()[0].endswith("raised ValueError: no such checkpoint"), err
    assert "in build_broken" in err and "conformance" not in err.replace("rosetta compare", ""), err
    # Other errors: one line, exit 2, no traceback.
    for factory, words in ((f"{user}:nothing", "no attribute"),
                           (f"{user}:build_not_a_model", "returned dict: expected a torch.nn.Module"),
                           (f"{tmp_path / 'absent.py'}:build", "no such Python file"),
                           ("user_model", "no such file or directory (expected a CTranslate2 model directory, ONNX graphs, or MODULE:FACTORY")):
        code, out, err = rosetta(capsys, "compare", factory, str(weights), *common)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (factory, err)
    state = system("from-scratch").state_dict()
    state.pop("fc_out.bias")
    torch.save(state, tmp_path / "short.pt")
    code, out, err = rosetta(capsys, "compare", f"{user}:build", str(tmp_path / "short.pt"), *common)
    assert code == 2 and "does not fit the model: 1 missing (fc_out.bias)" in err and len(err.strip().splitlines()) == 1, err
    state = system("from-scratch").state_dict()
    state["fc_out.weight"] = state["fc_out.weight"][:, :-1]
    torch.save(state, tmp_path / "narrow.pt")
    code, out, err = rosetta(capsys, "compare", f"{user}:build", str(tmp_path / "narrow.pt"), *common)
    assert code == 2 and "does not fit the model: fc_out.weight is (19, 31) in the file, (19, 32) in the model" in err, err
    assert len(err.strip().splitlines()) == 1, err
    code, out, err = rosetta(capsys, "compare", f"{user}:build", str(weights), *common, "--src", "1,2")
    assert code == 2 and "--tgt" in err, err

    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["compare"].format_help().split())
    assert "imports and runs your Python code" in help_text


LINEN_USER_FILE = '''
import dataclasses, sys
sys.path.insert(0, {tests!r})
from systems import flax_wmt as wmt

C = wmt.WmtConfig(vocab_size=19, output_vocab_size=23, emb_dim=32, num_heads=4, qkv_dim=32, mlp_dim=48, num_layers=2,
                  max_len=12)


def build():
    return wmt.Transformer(C)


def build_wide():
    return wmt.Transformer(dataclasses.replace(C, mlp_dim=64))
'''


def test_rosetta_compare_reads_a_linen_model_and_its_msgpack(tmp_path, capsys):
    """A flax.linen factory in a user file, its variables from a Flax .msgpack: clean (forward and
    gradients, labels the targets themselves for this shift-right model), and weights of another
    shape refused in one line before anything runs."""
    from pathlib import Path

    from flax import serialization

    user = tmp_path / "user_linen.py"
    user.write_text(LINEN_USER_FILE.replace("{tests!r}", repr(str(Path(__file__).resolve().parents[1]))))
    _, _, (_, variables), src, tgt = wmt_system("float32")
    weights = tmp_path / "params.msgpack"
    weights.write_bytes(serialization.to_bytes(variables))
    ids = lambda a: ";".join(",".join(str(int(x)) for x in row) for row in a)  # noqa: E731
    common = ["--layout", "flax-wmt", "--set", "max_len=12", "--backends", "none", "--src", ids(src), "--tgt", ids(tgt)]
    code, out, err = rosetta(capsys, "compare", f"{user}:build", str(weights), *common, "--grads")
    assert code == 0, out + err
    assert "first divergence: none" in out and "yours/cpu/float32" in out and "every gradient within tolerance" in out

    code, out, err = rosetta(capsys, "compare", f"{user}:build_wide", str(weights), *common)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(r"does not fit the model: params\.\S+\.MlpBlock_0\.Dense_0\.bias is \(48,\) in the file, "
                     r"\(64,\) in the model", err), err


# -- the [taps] format ---------------------------------------------------------------------------------


def test_every_builtin_layout_has_taps_that_name_canonical_tensors():
    from conformance.convert import builtin_layouts

    for layout in builtin_layouts():
        assert layout.taps, layout.name
        tensors = {tap.tensor for tap in layout.taps}
        assert {"encoder.embeddings", "encoder.{i}.ffn", "decoder.{i}.ffn"} <= tensors, layout.name


@pytest.mark.parametrize("name", ["algoperf-wmt-torch", "algoperf-wmt-flax"])
def test_taps_for_variants_apply_by_the_converted_switches(name, capsys):
    """AlgoPerf's pre-LN and post-LN compute a sublayer's output in different modules: one tap each,
    chosen by norm_placement; `rosetta layouts` shows the condition."""
    from conformance.check.foreign.taps import tapped
    from conformance.convert import load_layout

    layout = load_layout(name)
    pre = tapped(layout, ["encoder.1.self_attn"], {"norm_placement": "pre"})["encoder.1.self_attn"]
    post = tapped(layout, ["encoder.1.self_attn"], {"norm_placement": "post"})["encoder.1.self_attn"]
    assert pre[1].input == 0 and post[1].input is None and pre[0] != post[0], (pre, post)
    assert "encoder.1.self_attn" not in tapped(layout, ["encoder.1.self_attn"], {"norm_placement": "sandwich"})
    code, out, err = rosetta(capsys, "layouts", name)
    assert code == 0 and "when norm_placement = 'pre'" in out and "when norm_placement = 'post'" in out, out


@pytest.mark.parametrize("taps, problem", [
    ({"encoder.{i}.fnn": "x.{i}"}, "not a canonical tensor"),
    ({"encoder.{i}.ffn": "x"}, "must use {i} exactly when the tensor does"),
    ({"encoder.output": "x.{i}"}, "must use {i} exactly when the tensor does"),
    ({"encoder.output": {"module": "x", "input": 0, "output": 1}}, "reads one thing"),
    ({"encoder.output": {"module": "x", "layer": 0}}, "unknown field"),
    ({"encoder.output": {"module": "x", "call": -1}}, "call must be"),
    ({"encoder.output": {"module": "x", "input": True}}, "input must be"),
    ({"encoder.output": {"input": 0}}, "module must be"),
    ({"batch_axis": 2}, "batch_axis must be one of"),
    ({"decoder_input": "shift-left"}, "decoder_input must be one of"),
    ({"encoder.output": {"module": "x", "when": {"norm_placment": "pre"}}}, "norm_placment is not a ModelConfig switch"),
    ({"encoder.output": {"module": "x", "when": {}}}, "when must be a non-empty table of switches"),
    ({"encoder.output": []}, "an empty list of taps"),
])
def test_a_bad_tap_is_a_layout_error_naming_it(taps, problem):
    from conformance.convert import LayoutError
    from conformance.convert.layout import parse_layout

    data = {"matrices": "out-in", "keys": {"fc.weight": "output.weight"}, "taps": taps}
    with pytest.raises(LayoutError, match=re.escape(problem)):
        parse_layout(data, "mine")


def test_an_extending_layout_replaces_taps_one_by_one(tmp_path):
    from conformance.convert import load_layout

    path = tmp_path / "batch_first.toml"
    path.write_text('extends = "torch-nn-transformer"\n[taps]\nbatch_axis = 0\n'
                    '"logits" = { module = "head", output = 0 }\n')
    layout, base = load_layout(path), load_layout("torch-nn-transformer")
    assert layout.tap_options["batch_axis"] == 0 and base.tap_options["batch_axis"] == 1
    by_tensor = {tap.tensor: tap for tap in layout.taps}
    assert by_tensor["logits"].module == "head" and by_tensor["logits"].output == 0
    assert len(layout.taps) == len(base.taps)
    assert by_tensor["encoder.{i}.ffn"].module_for("encoder.3.ffn") == "transformer.encoder.layers.3"


def test_a_tap_that_cannot_be_read_says_why(tmp_path):
    """A module that runs twice without `call`, and one the model does not have: not exposed, with the reason."""
    path = tmp_path / "wrong.toml"
    path.write_text('extends = "from-scratch"\n[taps]\n"encoder.embeddings" = "positional_encoding"\n'
                    '"encoder.output" = "encoder.final"\n')
    report = conformance.compare(float64("from-scratch"), path, *batch("from-scratch"), n_heads=4, backends=())
    cells = {t: report.cells[(t, "yours/cpu/float64")] for t in ("encoder.embeddings", "encoder.output")}
    assert "ran 2 times; the tap must say which call" in cells["encoder.embeddings"].unavailable
    assert "has no module 'encoder.final'" in cells["encoder.output"].unavailable
    assert report.first_divergence is None and report.ok


def test_not_a_model_and_no_labels_are_named():
    from conformance.core.errors import InputError

    with pytest.raises(TypeError, match="torch.nn.Module"):
        conformance.compare(object(), "from-scratch", *batch("from-scratch"))
    with pytest.raises(InputError, match="labels"):
        run_compare("from-scratch", system("from-scratch"), backends=(), grads=True)


# -- an nnx.Module ------------------------------------------------------------------------------------


def test_an_nnx_model_is_read_by_its_module_paths(tmp_path):
    """A small nnx port of the from-scratch tutorial (its weights copied in), under a layout of its
    own: the same tensors as the torch original, through wrapped __call__s, and nnx.grad gradients."""
    pytest.importorskip("flax", reason="nnx is part of flax")
    import jax.numpy as jnp
    from flax import nnx

    torch_model = float64("from-scratch")
    state = {k: v.numpy() for k, v in torch_model.state_dict().items()}
    d, h = SIZES["d_model"], SIZES["n_heads"]

    class Linear(nnx.Module):
        def __init__(self, prefix, bias=True):
            self.w = nnx.Param(jnp.asarray(state[prefix + ".weight"].T))
            self.b = nnx.Param(jnp.asarray(state[prefix + ".bias"])) if bias else None

        def __call__(self, x):
            return x @ self.w[...] + (self.b[...] if self.b is not None else 0.0)

    class Norm(nnx.Module):
        def __init__(self, prefix):
            self.scale, self.bias = nnx.Param(jnp.asarray(state[prefix + ".weight"])), nnx.Param(jnp.asarray(state[prefix + ".bias"]))
            self.eps = 1e-5

        def __call__(self, x):
            mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
            return (x - mean) / jnp.sqrt(var + self.eps) * self.scale[...] + self.bias[...]

    class Attention(nnx.Module):
        def __init__(self, prefix):
            self.q, self.k, self.v = (Linear(f"{prefix}.W_{p}", bias=False) for p in "qkv")
            self.o = Linear(f"{prefix}.W_o")

        def __call__(self, x, kv, mask):
            split = lambda t: t.reshape(t.shape[0], t.shape[1], h, d // h).transpose(0, 2, 1, 3)
            scores = split(self.q(x)) @ split(self.k(kv)).transpose(0, 1, 3, 2) / jnp.sqrt(d // h)
            if mask is not None:
                scores = jnp.where(mask, scores, -1e9)
            out = jax_softmax(scores) @ split(self.v(kv))
            return self.o(out.transpose(0, 2, 1, 3).reshape(x.shape))

    def jax_softmax(x):
        e = jnp.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    class Ffn(nnx.Module):
        def __init__(self, prefix):
            self.linear1, self.linear2 = Linear(prefix + ".linear1"), Linear(prefix + ".linear2")

        def __call__(self, x):
            return self.linear2(jnp.maximum(self.linear1(x), 0.0))

    class EncoderLayer(nnx.Module):
        def __init__(self, i):
            p = f"encoder.layers.{i}"
            self.attn, self.ffn, self.norm1, self.norm2 = Attention(p + ".self_attn"), Ffn(p + ".ffn"), Norm(p + ".norm1"), Norm(p + ".norm2")

        def __call__(self, x, mask):
            x = self.norm1(x + self.attn(x, x, mask))
            return self.norm2(x + self.ffn(x))

    class DecoderLayer(nnx.Module):
        def __init__(self, i):
            p = f"decoder.layers.{i}"
            self.attn, self.cross, self.ffn = Attention(p + ".self_attn"), Attention(p + ".cross_attn"), Ffn(p + ".ffn")
            self.norm1, self.norm2, self.norm3 = Norm(p + ".norm1"), Norm(p + ".norm2"), Norm(p + ".norm3")

        def __call__(self, y, memory, mask):
            y = self.norm1(y + self.attn(y, y, mask))
            y = self.norm2(y + self.cross(y, memory, None))
            return self.norm3(y + self.ffn(y))

    class Model(nnx.Module):
        def __init__(self):
            self.src = nnx.Param(jnp.asarray(state["encoder_embedding.weight"]))
            self.tgt = nnx.Param(jnp.asarray(state["decoder_embedding.weight"]))
            # The sinusoid computed in float64 (the torch buffer is float32-rounded: 1e-7 off).
            position, div = np.arange(SIZES["max_len"])[:, None], np.exp(np.arange(0, d, 2) * -(math.log(10000.0) / d))
            pe = np.zeros((SIZES["max_len"], d))
            pe[:, 0::2], pe[:, 1::2] = np.sin(position * div), np.cos(position * div)
            self.pe = jnp.asarray(pe)  # a constant, not a parameter
            self.enc = nnx.List([EncoderLayer(i) for i in range(2)])
            self.enc_norm = Norm("encoder.norm")
            self.dec = nnx.List([DecoderLayer(i) for i in range(2)])
            self.out = Linear("fc_out")

        def __call__(self, src, tgt):
            x = self.src[...][src] * jnp.sqrt(d) + self.pe[: src.shape[1]]
            mask = (src != 0)[:, None, None, :]
            for layer in self.enc:
                x = layer(x, mask)
            memory = self.enc_norm(x)
            y = self.tgt[...][tgt] * jnp.sqrt(d) + self.pe[: tgt.shape[1]]
            t = tgt.shape[1]
            tgt_mask = (tgt != 0)[:, None, :, None] & jnp.tril(jnp.ones((t, t), bool))
            for layer in self.dec:
                y = layer(y, memory, tgt_mask)
            return self.out(y)

    layout = tmp_path / "nnx-from-scratch.toml"
    layout.write_text('''preset = "from-scratch"
matrices = "in-out"
switches = { position = "sinusoid-interleaved" }
[keys]
"src" = "encoder.embedding.weight"
"tgt" = "decoder.embedding.weight"
"enc.{i}.attn.{p:q|k|v}.w" = "encoder.layers.{i}.self_attn.{p}_proj.weight"
"enc.{i}.attn.o.{w:w=weight|b=bias}" = "encoder.layers.{i}.self_attn.o_proj.{w}"
"enc.{i}.ffn.{m:linear1|linear2}.{w:w=weight|b=bias}" = "encoder.layers.{i}.ffn.{m}.{w}"
"enc.{i}.{n:norm1=self_attn_norm|norm2=ffn_norm}.{w:scale=weight|bias}" = "encoder.layers.{i}.{n}.{w}"
"enc_norm.{w:scale=weight|bias}" = "encoder.norm.{w}"
"dec.{i}.{a:attn=self_attn|cross=cross_attn}.{p:q|k|v}.w" = "decoder.layers.{i}.{a}.{p}_proj.weight"
"dec.{i}.{a:attn=self_attn|cross=cross_attn}.o.{w:w=weight|b=bias}" = "decoder.layers.{i}.{a}.o_proj.{w}"
"dec.{i}.ffn.{m:linear1|linear2}.{w:w=weight|b=bias}" = "decoder.layers.{i}.ffn.{m}.{w}"
"dec.{i}.{n:norm1=self_attn_norm|norm2=cross_attn_norm|norm3=ffn_norm}.{w:scale=weight|bias}" = "decoder.layers.{i}.{n}.{w}"
"out.{w:w=weight|b=bias}" = "output.{w}"
[taps]
"encoder.{i}.self_attn" = "enc.{i}.norm1"
"encoder.{i}.ffn" = "enc.{i}"
"encoder.output" = "enc_norm"
"decoder.{i}.self_attn" = "dec.{i}.norm1"
"decoder.{i}.cross_attn" = "dec.{i}.norm2"
"decoder.{i}.ffn" = "dec.{i}"
''')
    import jax

    with jax.enable_x64(True):
        model = Model()
    src, tgt = batch("from-scratch")
    report = conformance.compare(model, layout, src, tgt, n_heads=h, max_len=SIZES["max_len"], backends=(), grads=True,
                                 labels=labels_for("from-scratch", tgt))
    assert report.yours.label == "yours/cpu/float64"
    assert report.first_divergence is None and report.ok, str(report)
    assert report.cells[("encoder.1.ffn", "yours/cpu/float64")].comparison.max_abs < 1e-12
    assert report.cells[("encoder.embeddings", "yours/cpu/float64")].unavailable
    assert {row.key for row in report.grads} >= {"src", "enc.0.attn.q.w", "out.b"}

    model.enc[1].norm2.eps = 1e-12  # planted: a wrong epsilon in one norm
    report = conformance.compare(model, layout, src, tgt, n_heads=h, max_len=SIZES["max_len"], backends=())
    assert_found(report, "encoder.1.ffn", "layer_norm_eps")
