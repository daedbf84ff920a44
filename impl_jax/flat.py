"""A model flattened for `jax.jit` once, and kept between calls while nothing it is made of changes.

Every compiled call hands the model to `jax.jit` as an argument (impl_jax/compiled.py), and jit
flattens that argument on each call: for an NNX model, a Python function per module, per module
state and per variable, 550 of them for the 6+6-layer base model, 0.84 ms on this project's CPU.
A forward runs two executables (encoder, decoder), a training step flattens the model twice more
to find its variables, and on a GPU that host work lies on the critical path (issue 28: the host
prepares the encoder's call while the device is idle).

So the model is flattened once and the result kept: its tree structure, its variables in leaf
order, and a record of everything that flattening read, which is checked again before each later
call (about 0.2 ms for the base model, against 0.85 ms for a flatten):

- each module (and module container, such as `nnx.List`): the names of its attributes and the
  identity of every value, in order. Replacing or adding a submodule, a variable or a static
  attribute (`model.config = ...`) changes one of them;
- each module's state object: its flags (`initializing`, `is_setup`), which are in the structure;
- each variable: its metadata (`set_metadata`), and that its value is still one array;
- each plain list or dict that flattening visits: the identity of its items, in order (and a
  dict's keys).

A variable's value is not recorded: it is read again on every call (`get_raw_value`), so setting
it (`variable.value = x`, `nnx.update`, the fused training step's writes) needs nothing more, and a
value of another shape or dtype gives jit another key, as before. When any check fails, the model
is flattened again and the record rebuilt: results are those of flattening on every call
(tests/test_jax_flat.py compares them, and plants each missed change).

A model holding anything else that flattening visits (a plain array attribute, a mutable container
other than a list or a dict, a pytree node of a type not listed above) is flattened on every call,
as before. A model's first compiled call only remembers it: the record (two tree flattens and the
walk above) is built at its second call, a forward's decoder, so that a model built for one
encoder call or one step pays one flatten, not three.

`KEEP = False` turns the record off: every call flattens.
"""

from __future__ import annotations

import itertools
import operator
import threading
import weakref
from typing import Any

import jax
import numpy as np
from flax import nnx

try:
    from flax.nnx.pytreelib import PytreeState
except ImportError:  # another Flax: a module's state object is then not recorded, and its model not kept
    PytreeState = ()

KEEP = True

# The leaf types a variable's value may hold for its value to be one leaf of the tree.
_ARRAYS = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)
_RAW_VALUE = operator.methodcaller("get_raw_value")


class Flat:
    """What jit receives instead of the model: the leaves as children, the structure as static data.
    Unflattened inside the traced function (`model()`), it is the model jit would have rebuilt."""

    __slots__ = ("treedef", "leaves")

    def __init__(self, treedef, leaves):
        self.treedef, self.leaves = treedef, leaves

    def model(self):
        return jax.tree.unflatten(self.treedef, self.leaves)


jax.tree_util.register_pytree_node(Flat, lambda flat: (flat.leaves, flat.treedef),
                                   lambda treedef, leaves: Flat(treedef, list(leaves)))


class _Record:
    """What flattening one model read, and its result (see the module docstring)."""

    __slots__ = ("treedef", "variables", "sharing", "attributes", "states", "metadata_of", "variables_metadata")

    def __init__(self, model):
        visited: list = []

        def visit(node) -> bool:
            visited.append(node)
            return isinstance(node, nnx.Variable)

        variables = jax.tree.leaves(model, is_leaf=visit)
        leaves, self.treedef = jax.tree.flatten(model)
        if len(leaves) != len(variables) or not all(isinstance(v, nnx.Variable) and leaf is v.get_raw_value()
                                                    for leaf, v in zip(leaves, variables)):
            raise _NotKept("a variable's value is not one leaf, or a leaf is not a variable's value")
        self.variables = variables
        first: dict[int, int] = {}  # a variable in two places (tied weights) is one variable
        self.sharing = tuple(first.setdefault(id(v), i) for i, v in enumerate(variables))
        # Each dict flattening reads (a module's attributes; a plain dict), or list: (it, its keys, its values).
        self.attributes: list[tuple[Any, tuple | None, tuple]] = []
        self.states, self.variables_metadata = [], []
        for node in visited:
            if isinstance(node, nnx.Variable):
                metadata = getattr(node, "_var_metadata", None)  # what its flattening reads (Flax 0.12)
                if not isinstance(metadata, dict):
                    raise _NotKept("a variable's metadata is not where this Flax keeps it")
                self.variables_metadata.append(dict(metadata))
            elif isinstance(node, (nnx.Pytree, dict)):
                attributes = vars(node) if isinstance(node, nnx.Pytree) else node
                self.attributes.append((attributes, tuple(attributes), tuple(attributes.values())))
            elif isinstance(node, list):
                self.attributes.append((node, None, tuple(node)))
            elif isinstance(node, PytreeState):
                self.states.append((node, node.initializing, node.is_setup))
            elif not (node is None or isinstance(node, tuple)):  # immutable: checked through its parent
                raise _NotKept(f"flattening visits a {type(node).__name__}")
        self.metadata_of = [v for v in visited if isinstance(v, nnx.Variable)]

    def holds(self) -> bool:
        """Whether flattening the model again would read what it read when this was recorded."""
        try:
            return self._holds()
        except RuntimeError:  # a dict changed size while read: the model is being changed on another thread
            return False

    def _holds(self) -> bool:
        for attributes, keys, values in self.attributes:  # the loops over items run in C
            if keys is None:
                if len(attributes) != len(values) or not all(map(operator.is_, attributes, values)):
                    return False
            elif tuple(attributes) != keys or not all(map(operator.is_, attributes.values(), values)):
                return False
        for node, initializing, is_setup in self.states:
            if node.initializing is not initializing or node.is_setup is not is_setup:
                return False
        return [v._var_metadata for v in self.metadata_of] == self.variables_metadata

    def leaves(self) -> list | None:
        """The variables' values now, or None where one is no longer a single leaf."""
        values = list(map(_RAW_VALUE, self.variables))
        return values if all(map(isinstance, values, itertools.repeat(_ARRAYS))) else None


class _NotKept(Exception):
    """This model cannot be recorded: it is flattened on every call."""


_LOCK = threading.Lock()
_SEEN, _REFUSED = "seen once", "cannot be kept"
_RECORDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Record, _SEEN or _REFUSED
_STATS = {"flattens": 0, "kept": 0}


def record(model) -> _Record | None:
    """The model's record, checked against the model now (rebuilt if anything changed), or None
    where it is not kept (a first call, `KEEP` off, a model that cannot be recorded)."""
    if not KEEP:
        return None
    try:
        with _LOCK:
            kept = _RECORDS.get(model)
            if kept is None:  # the first call: remembered, not recorded
                _RECORDS[model] = _SEEN
    except TypeError:  # a model that takes no weak reference
        return None
    if kept is None or kept is _REFUSED:
        return None
    if kept is not _SEEN and kept.holds():
        return kept
    try:
        kept = _Record(model)
    except _NotKept:
        kept = _REFUSED
    with _LOCK:
        _RECORDS[model] = kept
    return None if kept is _REFUSED else kept


def flattened(model) -> Flat | None:
    """`model` as jit's argument: from its record where one holds, else flattened now."""
    if model is None:
        return None
    kept = record(model)
    leaves = kept.leaves() if kept is not None else None
    if leaves is not None:
        with _LOCK:
            _STATS["kept"] += 1
        return Flat(kept.treedef, leaves)
    with _LOCK:
        _STATS["flattens"] += 1
    leaves, treedef = jax.tree.flatten(model)
    return Flat(treedef, leaves)


def variables(model) -> tuple[list, tuple[Any, tuple[int, ...]]]:
    """(the model's variables in leaf order, (its tree structure, which leaves are one variable)):
    from its record where one holds, else from two flattens (impl_jax.train.step_layout)."""
    kept = record(model)
    if kept is not None and kept.leaves() is not None:
        return kept.variables, (kept.treedef, kept.sharing)
    found = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, nnx.Variable))
    first: dict[int, int] = {}
    return found, (jax.tree.structure(model), tuple(first.setdefault(id(v), i) for i, v in enumerate(found)))


def stats() -> dict[str, int]:
    """Calls that flattened the model, and calls that took it from its record (for tests and reports)."""
    with _LOCK:
        return dict(_STATS)


def forget() -> None:
    """Drop every record (the next call of each model flattens it)."""
    with _LOCK:
        _RECORDS.clear()
