"""The three `model.py` files are one model written three times: this test fails when they drift.

It parses `impl_numpy/model.py`, `impl_torch/model.py` and `impl_jax/model.py` and compares, in
order: the section headers, the top-level names, the methods of each class, the positional
parameters of every function and method, and the first paragraph of every docstring (where the
equation lives). What differs for a framework's own reasons is on the allowlists below, each
with its reason; anything else that differs is drift. The three decode rooms (`impl_*/decode.py`:
the KV cache, the cached step, the search driver), the blocked output products
(`impl_*/blocks.py`) and the features source's front end (`impl_*/frontend.py`) are compared the
same way.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ("numpy", "torch", "jax")
REFERENCE = "numpy"  # the oracle is the file the others are read next to

# Top-level names only some backends have, and why.
IDIOM_NAMES = {
    "at_least_float32": ({"torch", "jax"}, "float16/bfloat16 are upcast for reductions; NumPy runs float32/64 only"),
    "fast_attention": ({"torch"}, "PyTorch's fused SDPA kernel, the path without attention weights"),
    "Sinusoid": ({"jax"}, "an nnx.Variable kind for the position constant: neither a parameter nor saved"),
    "optional_param": ({"jax"}, "nnx.Param or None, for the switchable biases"),
}
# Methods only some backends' classes have, and why.
IDIOM_METHODS = {
    "extra_repr": ({"torch"}, "nn.Module's printed summary"),
    "dtype": ({"torch"}, "a property: torch reads the dtype off a parameter; the others store it"),
    "_apply": ({"torch"}, "nn.Module's hook under .to()/.half()/.cuda(): with param_dtype given, a dtype change "
                          "recasts the parameters only and the sinusoid buffer stays in the compute dtype"),
    "params": ({"jax"}, "a property: the flattened nnx.Param state; NumPy keeps the dict, torch has state_dict()"),
    "_encode": ({"jax"}, "the compiled part of encode (one XLA executable per shape)"),
    "_decode": ({"jax"}, "the compiled part of decode"),
    "_loss_and_grads": ({"jax", "torch"}, "the device part of loss_and_grads: JAX compiles it (one XLA executable "
                                          "per shape), torch replays it from a CUDA graph (impl_torch/graphs.py)"),
    "_loss_args": ({"jax"}, "the host part of loss_and_grads, shared with the fused, donating impl_jax.train_step"),
    "traceable_forward": ({"jax"}, "the unchecked forward for use inside jax.jit / vmap (host checks cannot trace)"),
    "_placement": ({"jax"}, "the device and parameter dtype read once per call: each read goes through Flax's "
                            "variable and JAX's array properties (host work per call, issue 44)"),
    "_source": ({"jax"}, "encode's host checks, shared by the two-executable and the one-executable forward"),
    "_encoded": ({"jax"}, "encode returning the placement it ran with, so a forward's decoder does not read it again"),
    "_target": ({"jax"}, "decode's host checks, shared by the two-executable and the one-executable forward"),
    "_decoded": ({"jax"}, "decode given the encoder's placement"),
    "_forward_in_one": ({"jax"}, "the forward as one XLA executable (impl_jax.one_executable_forward(), off by "
                                 "default): _encode and _decode traced together"),
}
# The same for the decode rooms (impl_*/decode.py).
DECODE_IDIOM_NAMES = {
    "_start_cache": ({"jax"}, "the compiled part of start_cache"),
    "_reorder_cache": ({"jax"}, "the compiled part of reorder_cache"),
    "_decode_step": ({"jax"}, "the compiled part of decode_step (one executable for every step)"),
    "_search": ({"jax"}, "the compiled search: start_cache and every step in one lax.while_loop"),
    "_loop": ({"jax"}, "the search's lax.while_loop over any decoder: the model's cached step (_search) or "
                       "search_steps' step (_search_steps)"),
    "_search_steps": ({"jax"}, "the compiled search over search_steps' step: no model, so jax.jit, not compiled.call"),
    "cross_fix_ups": ({"torch"}, "the fused kernel's cross-attention fix-ups (fused.kernel_fix_ups), once per "
                                 "source instead of at every step"),
    "STEP_OUTPUT_COPY": ({"torch"}, "ROSETTA_TORCH_STEP_OUTPUT_COPY: whether step_output_weight copies"),
    "step_output_weight": ({"torch"}, "a tied W_out copied to (D, V) once per search on the CPU: MKL streams "
                                      "the transposed (V, D) layout at half the speed"),
    "advance": ({"numpy", "torch"}, "decode_step without the id checks, for the eager search's own ids; "
                                    "JAX's search calls the traced _decode_step inside its while_loop"),
}
_ADAPTER = ({"torch", "jax"}, "the device search's array adapter (Ops) in the framework's spelling; "
                               "NumPy's inherits conformance.core.generation.device.NumpyOps")
DECODE_IDIOM_METHODS: dict = {name: _ADAPTER for name in ("top_k", "sort", "cumsum", "take", "cast", "full", "arange",
                                                           "concat", "reduce", "argmax", "where", "mark")}
DECODE_IDIOM_METHODS["divide"] = ({"jax"}, "a division that XLA keeps a division: x / broadcast(y) is otherwise "
                                           "x * (1 / y), an ulp off the reference's quotient")
DECODE_IDIOM_METHODS["log_softmax"] = ({"torch"}, "torch's fused log-softmax (the others run the reference's formula)")
DECODE_IDIOM_METHODS["ban"] = ({"torch"}, "the banned columns written in place on the CPU (the others: NumpyOps' where)")
DECODE_IDIOM_METHODS["accumulate"] = ({"torch"}, "an in-place add into the step's own log-probabilities (the others: +)")
DECODE_IDIOM_METHODS["cond"] = ({"jax"}, "a traced condition runs one of two branches on the device (lax.cond); the others "
                                         "take NumpyOps' Python branch")
# The same for the blocked output product (impl_*/blocks.py).
BLOCKS_IDIOM_NAMES = {
    "_product_in_blocks_jvp": ({"jax"}, "the derivative of product_in_blocks as one product (jax.custom_jvp): "
                                        "through its loop, every block's gradient is a whole zero array"),
}
# Method names that mean the same: torch's nn.Module runs `forward` through `__call__`.
ALIASES = {"torch": {"forward": "__call__"}}
# Constructors are framework idioms: torch modules create empty parameters from (config, dtype)
# and the model loads its state dict once; NumPy and Flax wrap the given arrays by name. A function
# that picks which module to build (`positions`: T5's relative bias or a position term) is one.
CONSTRUCTOR_BACKENDS = {"numpy", "jax"}
CONSTRUCTOR_FUNCTIONS = {"positions"}
SECTION = re.compile(r"^# -- (.+?) -+$", re.M)


# Every file a backend splits by concern is held to the same rules as model.py.
FILES = {"model.py": (IDIOM_NAMES, IDIOM_METHODS), "decode.py": (DECODE_IDIOM_NAMES, DECODE_IDIOM_METHODS),
         "blocks.py": (BLOCKS_IDIOM_NAMES, {}),
         "frontend.py": ({}, {"extra_repr": IDIOM_METHODS["extra_repr"]})}


def source(backend: str, file: str = "model.py") -> str:
    return (ROOT / f"impl_{backend}" / file).read_text()


def skeleton(text: str, backend: str) -> dict:
    """Sections, top-level names, and per function/method (methods under their canonical name):
    positional parameters and docstring."""
    tree = ast.parse(text)
    names, classes, signatures, docs = [], {}, {}, {}

    def record(qualname: str, node) -> None:
        docs[qualname] = (ast.get_docstring(node) or "").split("\n\n")[0]
        if isinstance(node, ast.FunctionDef):
            args = node.args
            signatures[qualname] = [a.arg for a in args.posonlyargs + args.args if a.arg != "self"]

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
            record(node.name, node)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        if isinstance(node, ast.ClassDef):
            methods = []
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    methods.append(canonical(backend, item.name))
                    record(f"{node.name}.{canonical(backend, item.name)}", item)
            classes[node.name] = methods
    return {"sections": SECTION.findall(text), "names": names, "classes": classes,
            "signatures": signatures, "docs": docs}


def canonical(backend: str, name: str) -> str:
    return ALIASES.get(backend, {}).get(name, name)


def shared(names, backend: str, idioms: dict) -> list[str]:
    """`names` without the idioms that backend is allowed to have."""
    return [n for n in names if not (n in idioms and backend in idioms[n][0])]


def drift(reference: dict, other: dict, backend: str, file: str = "model.py") -> list[str]:
    idiom_names, idiom_methods = FILES[file]
    problems = []
    if reference["sections"] != other["sections"]:
        problems.append(f"sections differ: {reference['sections']} vs {other['sections']}")
    ref_names = shared(reference["names"], REFERENCE, idiom_names)
    names = shared(other["names"], backend, idiom_names)
    if ref_names != names:
        problems.append(f"top-level names differ (order matters): {ref_names} vs {names}")
    for cls, ref_methods in reference["classes"].items():
        if cls not in other["classes"]:
            continue  # reported with the names
        ref = shared(ref_methods, REFERENCE, idiom_methods)
        got = shared(other["classes"][cls], backend, idiom_methods)
        if ref != got:
            problems.append(f"methods of {cls} differ (order matters): {ref} vs {got}")
    for qualname, params in reference["signatures"].items():
        theirs = other["signatures"].get(qualname)
        if theirs is None:
            continue  # a missing name is reported above
        constructor = qualname.endswith("__init__") or qualname in CONSTRUCTOR_FUNCTIONS
        if constructor and not {REFERENCE, backend} <= CONSTRUCTOR_BACKENDS:
            continue
        if params != theirs:
            problems.append(f"positional parameters of {qualname} differ: {params} vs {theirs} "
                            "(backend extras must be keyword-only)")
    for qualname, doc in reference["docs"].items():
        theirs = other["docs"].get(qualname)
        if theirs is not None and theirs != doc:
            problems.append(f"docstring of {qualname} differs in its first paragraph:\n  {doc!r}\n  {theirs!r}")
    return problems


@pytest.mark.parametrize("file", list(FILES))
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != REFERENCE])
def test_model_files_are_parallel(backend, file):
    problems = drift(skeleton(source(REFERENCE, file), REFERENCE), skeleton(source(backend, file), backend),
                     backend, file)
    assert not problems, f"impl_{backend}/{file} drifted from impl_{REFERENCE}/{file}:\n" + "\n".join(problems)


@pytest.mark.parametrize("file", list(FILES))
def test_the_allowlists_name_only_what_exists(file):
    """An allowlist entry that no longer matches anything hides nothing and must go."""
    idiom_names, idiom_methods = FILES[file]
    skeletons = {b: skeleton(source(b, file), b) for b in BACKENDS}
    for name, (owners, why) in idiom_names.items():
        for backend in owners:
            assert name in skeletons[backend]["names"], f"{name} ({why}) is not in impl_{backend}/{file}"
    for name, (owners, why) in idiom_methods.items():
        for backend in owners:
            assert any(name in methods for methods in skeletons[backend]["classes"].values()), (
                f"method {name} ({why}) is in no class of impl_{backend}/{file}")


def test_drift_is_caught():
    """The comparison has teeth: a renamed function, a reordered section, an extra positional
    parameter and an edited equation are each reported."""
    reference = source(REFERENCE)
    text = source("torch")
    cases = {
        "top-level names differ": text.replace("def causal_mask(", "def lower_triangle("),
        "sections differ": text.replace("# -- Feed-forward", "# -- Feedforward"),
        "positional parameters of EncoderLayer.__call__ differ": re.sub(
            r"def forward\(self, x: torch.Tensor, src_mask, name: str, out",
            "def forward(self, x: torch.Tensor, src_mask, name: str, extra, out", text, count=1),
        "docstring of scaled_dot_product_attention differs": text.replace(
            "Attention(Q, K, V) = softmax(Q K^T / sqrt(K) + bias) V", "Attention(Q, K, V) = softmax(Q K^T) V"),
    }
    for expected, broken in cases.items():
        assert broken != text, f"the planted drift for {expected!r} did not apply"
        problems = drift(skeleton(reference, REFERENCE), skeleton(broken, "torch"), "torch")
        assert any(expected in p for p in problems), f"{expected!r} not reported: {problems}"


def test_blocks_drift_is_caught():
    """The blocked output products are compared too: a renamed function is reported."""
    blocks = source("torch", "blocks.py")
    broken_blocks = blocks.replace("def product_in_blocks(", "def product_by_blocks(")
    assert broken_blocks != blocks
    problems = drift(skeleton(source(REFERENCE, "blocks.py"), REFERENCE), skeleton(broken_blocks, "torch"), "torch",
                     "blocks.py")
    assert any("top-level names differ" in p for p in problems), problems


def test_frontend_drift_is_caught():
    """The front ends are compared too: a changed stride in an equation's docstring is reported."""
    text = source("jax", "frontend.py")
    broken = text.replace("conv(x, W, b, s)[t] = sum_k x[s t + k - 1] W[k] + b", "conv(x, W, b, s)[t] = sum_k x[s t + k] W[k] + b")
    assert broken != text
    problems = drift(skeleton(source(REFERENCE, "frontend.py"), REFERENCE), skeleton(broken, "jax"), "jax", "frontend.py")
    assert any("docstring of conv1d differs" in p for p in problems), problems


def test_decode_drift_is_caught():
    """The decode rooms are compared too: a renamed function and an edited docstring are reported."""
    reference = source(REFERENCE, "decode.py")
    text = source("torch", "decode.py")
    cases = {
        "top-level names differ": text.replace("def layer_caches(", "def caches_of_layers("),
        "docstring of decode_step differs": text.replace("the cache advances by one", "the cache advances"),
    }
    for expected, broken in cases.items():
        assert broken != text, f"the planted drift for {expected!r} did not apply"
        problems = drift(skeleton(reference, REFERENCE), skeleton(broken, "torch"), "torch", "decode.py")
        assert any(expected in p for p in problems), f"{expected!r} not reported: {problems}"
