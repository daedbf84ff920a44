"""Your own backend as a target of the conformance suite: the adapter protocol (docs/own-backend.md).

    rosetta conformance --backends numpy,my_pkg.adapter:build     a module (or my_adapter.py) and its factory
    rosetta conformance --backends my-model                       an installed `rosetta.backends` entry point

An adapter is a factory and the object it returns:

    build(config: ModelConfig, params: dict[str, np.ndarray], dtype: str) -> model
        config   the drawn config, already held to the switches the factory declares (below)
        params   float64 NumPy arrays under rosetta's canonical names (`conformance.core.params`):
                 convert them to your own keys (`conformance.convert.export_state_dict`)
        dtype    "float32" unless the factory declares `dtypes`
    model.forward(src_ids, tgt_ids) -> logits                          (B, T, V), any array type
    model.intermediates(src_ids, tgt_ids) -> {name: tensor}            rosetta's names (core/output.py)
    model.generate(src_ids, max_len, bos_id, eos_id, **options) -> ids      optional (docs/decoding.md)
    model.loss_and_grads(src_ids, tgt_ids, labels, *, label_smoothing)      optional (docs/training.md)
        -> (loss, {canonical parameter name: gradient})

Ids are int64 NumPy arrays (B, S) and (B, T); padding is `config.pad_id`. `intermediates` returns
the tensors the model exposes, by the names of `conformance.core.output.forward_order` (the
residual stream after each sublayer, attention weights as `encoder.0.self`): each one returned is
compared with the oracle; one never returned is listed as not exposed in the run's report, never
counted as agreeing; a name rosetta does not know (a typo: that tensor would be compared nowhere)
fails the property, named. A method the model does not have is a property skipped by name (the
property and what it needs), never a pass.

Two optional attributes of the factory say what the model can be:

    build.dtypes = ("float32", "float64")          the dtypes it runs (default: float32)
    build.switches = {"activation": ("relu", "gelu"), "position": "sinusoid-interleaved", ...}

`switches` holds a `ModelConfig` field to one value, or to the values the model has: a drawn
config's other values become one of those listed (chosen by a hash of the drawn config, the
same one every time, so that each listed value runs), before the model and the oracle are built,
so that every example is a model the adapter can be. A held pad id swaps places with the drawn
one in the example's ids, so padding stays padding (`conformance.suite.runner.for_target`).
`switches_of(preset, free=...)` builds it from a system's preset. Sizes (d_model, heads, layers,
vocabularies, max_len) are always drawn. Switches that move together are held as combinations:
a tuple of fields as the key, the list of value tuples the model has as the value.

    build.switches = {("qkv_bias", "out_proj_bias"): [(True, True), (False, False)],
                      ("activation", "ffn_glu"): [("relu", False), ("silu", True)]}

Three more optional attributes say what the model cannot be held to by a switch:

    build.frozen = ("final_logits_bias",)          canonical parameters it never trains (fnmatch
                                                   patterns): the gradient property skips them by name
    build.searches = ("greedy", "beam")            the searches its own `generate` runs (`SEARCHES`):
                                                   the generate property draws only those
    build.known_differences = [dict(tensor=..., when={...}, condition=..., reason=...)]
                                                   or a TOML file beside the adapter: differences
                                                   acknowledged (`KnownDifference`), reported apart

May import: the core and NumPy; the adapter's own module when it is asked for.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import importlib
import importlib.metadata
import importlib.util
import sys
import zlib
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from conformance.core.config import ModelConfig
from conformance.core.errors import InputError
from conformance.core.output import ModelOutput, forward_order
# The declarations' vocabulary and checks (re-exported here, the protocol's module).
from conformance.check.targets.declarations import (CONDITIONS, PROBE, PROPERTY_NAMES, SEARCHES, SIZES,  # noqa: F401
                                                    AdapterError, KnownDifference, canonical_gradients, refused)

GROUP = "rosetta.backends"  # the entry-point group of installed adapters
OPTIONAL = ("generate", "loss_and_grads")  # what an adapter may leave out
REQUIRED = ("forward", "intermediates")
DEFAULT_DTYPES = ("float32",)


def looks_like_adapter(name: str) -> bool:
    """Whether a `--backends` name is a MODULE:FACTORY (rather than a backend or entry-point name)."""
    return ":" in name


def installed() -> dict[str, importlib.metadata.EntryPoint]:
    """The adapters installed packages offer: entry points of group `rosetta.backends`, by name."""
    return {point.name: point for point in importlib.metadata.entry_points(group=GROUP)}


def load_factory(name: str) -> Callable:
    """The factory of `name`: `package.module:build`, `my_adapter.py:build`, or an installed entry
    point's name. AdapterError, one line, when it cannot be had."""
    if not looks_like_adapter(name):
        points = installed()
        if name not in points:
            raise AdapterError(f"unknown backend {name!r}: not a built-in one, no MODULE:FACTORY, and no installed "
                               f"package offers it as a {GROUP!r} entry point (installed: {sorted(points) or 'none'})")
        try:
            factory = points[name].load()
        except Exception as exc:  # noqa: BLE001 - the user's package failing to import is one line
            raise AdapterError(f"backend {name!r}: loading entry point {points[name].value} failed: "
                               f"{type(exc).__name__}: {exc}") from None
        where = f"{name} (entry point {points[name].value})"
    else:
        module_text, _, attribute = name.rpartition(":")
        if not module_text or not attribute:
            raise AdapterError(f"{name!r}: expected MODULE:FACTORY (my_adapter.py:build or my_pkg.adapter:build)")
        module = _import(module_text, name)
        factory = getattr(module, attribute, None)
        where = name
    if factory is None or not callable(factory):
        raise AdapterError(f"{where}: no function {name.rpartition(':')[2]!r} to build the model with")
    return factory


def _import(module_text: str, name: str):
    path = Path(module_text)
    try:
        if module_text.endswith(".py"):
            if not path.is_file():
                raise AdapterError(f"{name}: no such Python file {module_text}")
            # Keyed by the file's resolved path: a/adapter.py and b/adapter.py are two adapters.
            digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
            module_name = f"rosetta_adapter_{path.stem}_{digest}"
            if module_name in sys.modules:  # loaded once per process: the CLI's check, then the plugin
                return sys.modules[module_name]
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.path.insert(0, str(path.resolve().parent))  # its own imports of files beside it
            try:
                spec.loader.exec_module(module)
            finally:
                sys.path.remove(str(path.resolve().parent))
            sys.modules[module_name] = module
            return module
        return importlib.import_module(module_text)
    except AdapterError:
        raise
    except Exception as exc:  # noqa: BLE001 - one line naming the module, not our traceback
        raise AdapterError(f"{name}: importing {module_text} failed: {type(exc).__name__}: {exc}") from None


def switches_of(preset_name: str, free: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every switch of a preset (`conformance.core.presets`) held at its value, except `free`:
    the `switches` of an adapter whose model is that system with a few constructor arguments."""
    from conformance.core.presets import preset

    config = preset(preset_name)
    unknown = sorted(set(free) - {f.name for f in fields(config)})
    if unknown:
        raise AdapterError(f"switches_of({preset_name!r}): {unknown} are not ModelConfig fields")
    return {f.name: getattr(config, f.name) for f in fields(config) if f.name not in SIZES and f.name not in free}


def conform(config: ModelConfig, switches: dict[str, Any]) -> ModelConfig:
    """`config` with each held switch at a value the adapter's model has: the drawn one when it
    is among them, else one of them chosen by the drawn config (`held_value`); a held combination
    (a tuple of fields) likewise, all its fields at once. ConfigError when the result is not a
    valid config (say, shared embeddings held on over two vocabulary sizes)."""
    changes = {}
    for name, allowed in switches.items():
        values = held_values(allowed)
        if isinstance(name, tuple):  # a combination: the drawn one, or one of those listed
            drawn = tuple(getattr(config, field) for field in name)
            if drawn not in [tuple(v) for v in values]:
                changes.update(zip(name, held_value(" ".join(name), config, values)))
        elif getattr(config, name) not in values:
            changes[name] = held_value(name, config, values)
    return config.replace(**changes) if changes else config


def held_values(allowed) -> tuple:
    """A held switch's values: one value, or the tuple (or list) of them."""
    return tuple(allowed) if isinstance(allowed, (tuple, list)) else (allowed,)


def held_value(name: str, drawn: ModelConfig, values: tuple) -> Any:
    """The held value switch `name` of a drawn config outside `values` becomes: picked by a hash
    of the whole drawn config (CRC-32 of its JSON, the same in every process), so that over the
    examples every listed value runs, rather than the first one only (which made the others
    checked only when drawn themselves)."""
    return values[zlib.crc32(f"{name} {drawn.to_json()}".encode()) % len(values)]


def check_switches(name: str, switches: dict) -> None:
    """AdapterError naming the first held switch (or combination) no config can have: a field that
    is no switch, one held twice, a combination of the wrong length, a value ModelConfig refuses."""
    switch_names = {f.name for f in fields(ModelConfig)} - SIZES
    held = [field for key in switches for field in (key if isinstance(key, tuple) else (key,))]
    bad = sorted(set(held) - switch_names)
    if bad:
        raise AdapterError(f"{name}: switches {bad} are not ModelConfig switches (sizes are always drawn)")
    twice = sorted({field for field in held if held.count(field) > 1})
    if twice:
        raise AdapterError(f"{name}: switches holds {twice} more than once (alone or in a combination): "
                           "hold each field in one place")
    for key, allowed in switches.items():
        fields_ = key if isinstance(key, tuple) else (key,)
        for combination in held_values(allowed):
            values = tuple(combination) if isinstance(key, tuple) else (combination,)
            if len(values) != len(fields_):
                raise AdapterError(f"{name}: switches holds {fields_} to {combination!r}: a combination gives one "
                                   f"value per field ({len(fields_)})")
            for switch, value in zip(fields_, values):
                problem = refused(switch, value)
                if problem:
                    raise AdapterError(f"{name}: switches holds {switch} to {value!r}, which no config can have: "
                                       f"{problem}")


class Adapter:
    """A loaded adapter: its factory, the dtypes, switches, frozen parameters, searches and known
    differences it declares, and what it offers."""

    def __init__(self, name: str, factory: Callable):
        from conformance.check.targets.declarations import frozen_patterns, known_differences, searches

        self.name, self.factory = name, factory
        self.dtypes = tuple(getattr(factory, "dtypes", DEFAULT_DTYPES))
        self.switches = dict(getattr(factory, "switches", {}))
        check_switches(name, self.switches)
        self.frozen = frozen_patterns(name, getattr(factory, "frozen", ()))
        self.searches = searches(name, getattr(factory, "searches", SEARCHES))
        self.known = known_differences(name, factory, getattr(factory, "known_differences", ()))
        self._offers: tuple[str, ...] | None = None
        self.not_exposed: dict[str, set[str]] = {}  # target label -> tensors the oracle has and the model never gave

    def conform(self, config: ModelConfig) -> ModelConfig:
        return conform(config, self.switches)

    def build(self, config: ModelConfig, params: dict[str, np.ndarray], dtype: str) -> Any:
        try:
            model = self.factory(config, params, dtype)
        except Exception as exc:
            raise AdapterError(f"{self.name}: build(config, params, {dtype!r}) raised {type(exc).__name__}: {exc}") from exc
        missing = [method for method in REQUIRED if not callable(getattr(model, method, None))]
        if missing:
            raise AdapterError(f"{self.name}: the model build returned ({type(model).__name__}) has no "
                               f"{' or '.join(missing)}, which every adapter needs (docs/own-backend.md)")
        return model

    def offers(self) -> tuple[str, ...]:
        """The methods of the protocol the adapter's model has: one small model built once to see."""
        if self._offers is None:
            from conformance.core.params import init_params

            pads = [p for p in held_values(self.switches.get("pad_id", ())) if isinstance(p, int)]
            vocab = max([8, *(p + 1 for p in pads)])
            try:
                config = self.conform(PROBE.replace(src_vocab_size=vocab, tgt_vocab_size=vocab))
            except ValueError as exc:
                raise AdapterError(f"{self.name}: its switches make no valid config: {exc}") from None
            model = self.build(config, init_params(config, seed=0), self.dtypes[0])
            self._offers = tuple(m for m in (*REQUIRED, *OPTIONAL) if callable(getattr(model, m, None)))
        return self._offers

    def describe(self) -> str:
        lacks = [m for m in OPTIONAL if m not in self.offers()]
        held = ", ".join(f"({', '.join(k)}) in {list(held_values(v))!r}" if isinstance(k, tuple) else f"{k}={v!r}"
                         for k, v in self.switches.items()) or "none"
        more = "".join([f"; frozen: {', '.join(self.frozen)}" if self.frozen else "",
                        f"; searches: {', '.join(self.searches)}" if self.searches != SEARCHES else "",
                        f"; {len(self.known)} known difference(s)" if self.known else ""])
        return (f"adapter {self.name}: offers {', '.join(self.offers())}"
                + (f"; no {', no '.join(lacks)}" if lacks else "") + f"; dtypes {list(self.dtypes)}; switches held: {held}"
                + more)

    def is_frozen(self, parameter: str) -> bool:
        """Whether the adapter declared canonical parameter `parameter` frozen (never trained)."""
        return any(fnmatch.fnmatchcase(parameter, pattern) for pattern in self.frozen)

    def backend(self) -> "AdapterBackend":
        return AdapterBackend(self)


class AdapterBackend:
    """An adapter with a backend's surface (`conformance.check.backends`): `Model`, the dtypes,
    and the precision scope, so that the suite's runner builds and calls it as any backend."""

    def __init__(self, adapter: Adapter):
        self.adapter = adapter
        self.SUPPORTED_DTYPES = adapter.dtypes
        outer = self

        class Model(AdapterModel):
            def __init__(self, config, params, dtype=None, *, device=None, param_dtype=None):
                super().__init__(outer.adapter, config, params, dtype or outer.adapter.dtypes[0], device, param_dtype)

        Model.__name__ = Model.__qualname__ = "Model"
        self.Model = Model

    @staticmethod
    @contextlib.contextmanager
    def full_precision() -> Iterator[None]:
        """Nothing to switch: an adapter runs on the CPU, where no matmul rounds its inputs (TF32)."""
        yield

    @staticmethod
    def precision_settings() -> dict[str, Any]:
        return {}


class AdapterModel:
    """The adapter's model behind the call the suite makes on every backend:
    `model(src_ids, tgt_ids)` -> ModelOutput(logits, attention, intermediates)."""

    def __init__(self, adapter: Adapter, config: ModelConfig, params, dtype: str, device, param_dtype):
        if dtype not in adapter.dtypes:
            raise InputError("dtype", f"{dtype!r} is not one the adapter {adapter.name} declares ({list(adapter.dtypes)})")
        if device not in (None, "cpu"):
            raise InputError("device", f"adapter {adapter.name} runs on the CPU target only, not {device!r}")
        self.adapter, self.config = adapter, config
        self.model = adapter.build(config, {k: np.asarray(v, np.float64) for k, v in params.items()}, dtype)

    def __call__(self, src_ids, tgt_ids, src_mask=None, tgt_mask=None, *, return_attention: bool = True):
        if src_mask is not None or tgt_mask is not None or not return_attention:
            raise AdapterError(f"{self.adapter.name}: the adapter protocol calls forward(src_ids, tgt_ids) only: "
                               "no explicit masks, no fast path")
        logits = self.model.forward(src_ids, tgt_ids)
        tensors = dict(self.model.intermediates(src_ids, tgt_ids))
        tensors.pop("logits", None)
        unknown = sorted(set(tensors) - set(forward_order(self.config)))
        if unknown:  # a typo would leave that tensor compared nowhere
            raise AdapterError(f"{self.adapter.name}: intermediates returned {unknown}, which this config's forward "
                               f"pass does not have; rosetta's names are {forward_order(self.config)[:-1]} "
                               "(conformance.core.output.forward_order)")
        attention = {k: v for k, v in tensors.items() if k.endswith((".self", ".cross"))}
        rest = {k: v for k, v in tensors.items() if k not in attention}
        return ModelOutput(logits=logits, attention=attention, intermediates=rest)

    def __getattr__(self, name: str):
        if name in OPTIONAL:  # present only when the adapter's model has it
            return getattr(self.model, name)
        raise AttributeError(name)

