"""A model flattened for `jax.jit` once, and kept between calls while nothing it is made of changes.

Every compiled call hands the model to `jax.jit` as an argument (impl_jax/compiled.py), and jit
flattens that argument on each call: for an NNX model, a Python function per module, per module
state and per variable, 550 of them for the 6+6-layer base model, about 0.85 ms on this project's
CPU. A forward runs two executables (encoder, decoder), a training step flattened the model twice
more to find its variables, and on a GPU that host work lies on the critical path (issue 28: the
host prepares the encoder's call while the device is idle).

So the model is flattened once and the result kept: its tree structure, its variables in leaf
order, and a copy of everything that flattening read, taken as it read it (in the same pass),
which is checked again before each later call (0.11-0.13 ms for the base model's 369 objects on
this project's loaded CPU; every comparison runs in C, without a Python frame per module):

- each module (and module container, such as `nnx.List`): its type, that its attribute dict is
  the same object, how many attributes it has, their names and the identity of every value, in order.
  Replacing or adding a submodule, a variable or a static attribute (`model.config = ...`)
  changes one of them;
- each module's state object: its flags (`initializing`, `is_setup`), which are in the structure;
- each variable: its type, its metadata (`set_metadata`; compared by equality, so metadata set to
  an equal value of another type, 1.0 for 1, keeps the record: jit's cache key compares it the same
  way), and that its value is still one array;
- each plain list or dict that flattening visits: the identity of its items, in order (and a
  dict's keys).

A variable's value is not recorded: it is read again on every call (`get_raw_value`), so setting
it (`variable.value = x`, `nnx.update`, the fused training step's writes) needs nothing more, and a
value of another shape or dtype gives jit another key, as before. When any check fails, the model
is flattened again and the record rebuilt (tests/backends/jax/test_jax_flat.py plants each missed change). Each
node's copy is taken as flattening reaches it, so a change made on another thread while the record
is built is seen at the next call. What is not covered: changes to Flax's private state in place
(a module's `_pytree__nodes` mapping, class attributes); and, as for any Python object, a model
changed on one thread while another calls it gives that call either state.

Not recorded, so flattened on every call as before: a model holding anything else that
flattening visits (a plain array attribute, a container of another type, a pytree node of a type
not listed above), a variable whose value is not one array, or a static attribute that is not
plain data. Plain data is None, booleans, numbers, strings and bytes, NumPy dtypes and scalars,
enum members, classes, built-in functions and module-level functions without a closure, and
tuples, lists, sets, dicts and dataclasses (their fields only) of them. Anything else, a bound
method or a closure say, could refer back to the model, which its record would then keep alive.
(Flax's own layers hold jitted functions as attributes, so `nnx.Linear` and its kind are not
recorded; this backend's model holds none.) A class attribute or an enum member's own attribute
pointing at a model is not looked for. Such a model is tried again every `RETRY_AFTER` calls. A
model's first compiled call only remembers it: the record (one flatten that also copies what it
reads: 3.6-4.4 ms for the base structure, four to five plain flattens) is built at its second
call, a forward's decoder, and again after each change of its structure, so that a model built
for one encoder call or one step pays one flatten.

The records are kept by the model's identity (a weak reference whose callback drops the entry,
without taking the table's lock: it can run inside any allocation, on a thread that holds it),
never by its equality. `KEEP = False` turns them off: every call flattens.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import operator
import threading
import types
import weakref
from typing import Any

import jax
import numpy as np
from flax import nnx

try:
    from flax.nnx.pytreelib import PytreeState
except ImportError:  # another Flax: a module's state object is then an unknown node, and its model not recorded
    PytreeState = ()
try:
    from flax.typing import HashableMapping  # each module's `_pytree__nodes`
except ImportError:
    HashableMapping = None

KEEP = True
RETRY_AFTER = 100  # calls of a model that could not be recorded before it is tried again

# The leaf types a variable's value may hold for its value to be one leaf of the tree.
_ARRAYS = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)
# What a variable's flattening reads (Flax 0.12: `_variable_flatten`), read from C.
_RAW_VALUE = operator.attrgetter("_raw_value")
_METADATA = operator.attrgetter("_var_metadata")
_VARS = operator.attrgetter("__dict__")
# Static attributes that cannot refer back to a model (containers of them are checked item by item).
_PLAIN = (type(None), bool, int, float, complex, str, bytes, np.dtype, np.generic, enum.Enum, type)
_SCALARS = frozenset({type(None), bool, int, float, complex, str, bytes, types.BuiltinFunctionType})
# Mappings whose only state is their items (a user's Mapping type may hold anything else).
_MAPPINGS = (dict, types.MappingProxyType, *((HashableMapping,) if HashableMapping else ()))


def _flag_reader():
    """What a module's state object's flattening reads (`initializing`, `is_setup`): from C
    where Flax 0.12 keeps them in the slots `_initializing` and `_is_setup` behind plain
    properties (checked here on two probes), else through the properties (a Python call each)."""
    public = operator.attrgetter("initializing", "is_setup")
    if not PytreeState:
        return public
    direct = operator.attrgetter("_initializing", "_is_setup")
    try:
        probes = [PytreeState(initializing=a, is_setup=b) for a, b in ((True, False), (False, True))]
        if all(direct(x) == public(x) == flags for x, flags in zip(probes, ((True, False), (False, True)))):
            return direct
    except Exception:  # another layout
        pass
    return public


_FLAGS = _flag_reader()


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


class _NotKept(Exception):
    """This model cannot be recorded: it is flattened on every call."""


def _plain(value, depth: int = 0) -> bool:
    """Whether a static attribute is data that cannot refer back to a model (module docstring)."""
    try:
        return _plain_data(value, depth)
    except Exception:  # an object that cannot even be read (an unset field, a mapping that raises): not kept
        return False


def _plain_data(value, depth: int) -> bool:
    if type(value) in _SCALARS or isinstance(value, _PLAIN):
        return True
    if isinstance(value, types.FunctionType):  # a module-level function refers to no instance; a closure might
        return value.__closure__ is None
    if depth > 8:
        return False
    if type(value) in (tuple, list, frozenset, set):
        return set(map(type, value)) <= _SCALARS or all(_plain_data(x, depth + 1) for x in value)
    if type(value) in _MAPPINGS:  # (each module's `_pytree__nodes`: names to flags, checked in C)
        if set(map(type, value.keys())) <= _SCALARS and set(map(type, value.values())) <= _SCALARS:
            return True
        return all(_plain_data(k, depth + 1) and _plain_data(v, depth + 1) for k, v in value.items())
    if dataclasses.is_dataclass(value):  # its fields, and nothing else stored on it
        names = {f.name for f in dataclasses.fields(value)}
        if not set(getattr(value, "__dict__", {})) <= names:
            return False
        return all(_plain_data(getattr(value, name), depth + 1) for name in names)
    return False


class _Record:
    """What flattening one model read, and its result (see the module docstring)."""

    __slots__ = ("model", "root", "treedef", "variables", "sharing", "objects", "types", "modules", "module_dicts", "dicts",
                 "keys", "values", "lists", "list_values", "states", "flags", "metadata", "sizes", "all_keys", "all_values",
                 "list_sizes", "list_items")

    def __init__(self, model):
        if not isinstance(model, nnx.Pytree):
            raise _NotKept(f"a {type(model).__name__} is not an NNX module")
        self.model, self.root = weakref.ref(model), (type(model), vars(model))
        self.objects, self.modules, self.module_dicts, self.dicts, self.keys, self.values = [], [], [], [], [], []
        self.lists, self.list_values, self.states, self.variables, self.metadata = [], [], [], [], []
        unknown: list = []
        tuples: list = []

        def copy(node) -> bool:  # called on each node right before flattening reads it
            if isinstance(node, nnx.Variable):
                metadata = getattr(node, "_var_metadata", None)  # what its flattening reads (Flax 0.12)
                if not isinstance(metadata, dict):
                    unknown.append(node)
                self.objects.append(node)
                self.variables.append(node)
                self.metadata.append(dict(metadata or {}))
            elif isinstance(node, nnx.Pytree) or type(node) is dict:
                attributes = vars(node) if isinstance(node, nnx.Pytree) else node
                if isinstance(node, nnx.Pytree) and node is not model:  # the model itself: by weak reference
                    self.objects.append(node)
                    self.modules.append(node)
                    self.module_dicts.append(attributes)
                self.dicts.append(attributes)
                self.keys.append(tuple(attributes))
                self.values.append(tuple(attributes.values()))
            elif type(node) is list:
                self.lists.append(node)
                self.list_values.append(tuple(node))
            elif PytreeState and isinstance(node, PytreeState):
                self.states.append(node)
            elif type(node) is tuple:  # immutable: its items are checked as nodes of their own
                tuples.append(node)
            elif not (node is None or isinstance(node, _ARRAYS)):
                unknown.append(node)  # arrays: a variable's value, or a bare leaf (counted below)
            return False

        leaves, self.treedef = jax.tree.flatten(model, is_leaf=copy)
        if unknown:
            raise _NotKept(f"flattening visits a {type(unknown[0]).__name__}")
        if len(leaves) != len(self.variables) or not all(map(operator.is_, leaves, map(_RAW_VALUE, self.variables))):
            raise _NotKept("a variable's value is not one leaf, or a leaf is not a variable's value")
        self.types = tuple(map(type, self.objects))
        nodes = {id(x) for x in itertools.chain(self.objects, self.lists, self.dicts, tuples)}
        nodes.update(map(id, self.states))
        plain: set[int] = set()  # the same config or dtype is an attribute of many modules: checked once
        for value in itertools.chain.from_iterable(self.values):
            if id(value) not in nodes and id(value) not in plain:
                if not _plain(value):
                    raise _NotKept(f"a static attribute is a {type(value).__name__}, which could refer back to the model")
                plain.add(id(value))
        if not all(_plain(m) for m in self.metadata):
            raise _NotKept("a variable's metadata is not plain data")
        self.sharing = _sharing(self.variables)
        # What `_holds` compares, laid end to end so that one C-level pass checks every module:
        # each dict's size, then all keys and all values in order (with the sizes equal, equal
        # concatenations mean each dict's keys and values are the same); the same for the lists.
        self.sizes = list(map(len, self.keys))
        self.all_keys = list(itertools.chain.from_iterable(self.keys))
        self.all_values = list(itertools.chain.from_iterable(self.values))
        self.list_sizes = list(map(len, self.list_values))
        self.list_items = list(itertools.chain.from_iterable(self.list_values))
        self.flags = list(itertools.chain.from_iterable(map(_FLAGS, self.states)))

    def holds(self, model) -> bool:
        """Whether flattening `model` now would read what it read when this was recorded."""
        try:
            return (self.model() is model and type(model) is self.root[0] and vars(model) is self.root[1]
                    and self._holds())
        except Exception:  # a dict resized by another thread; metadata that does not compare: rebuilt
            return False

    def _holds(self) -> bool:
        # Every loop over items runs in C (map, chain, list equality): no Python frame per module.
        if not all(map(operator.is_, map(type, self.objects), self.types)):
            return False
        if not all(map(operator.is_, map(_VARS, self.modules), self.module_dicts)):
            return False
        if list(map(len, self.dicts)) != self.sizes or list(itertools.chain.from_iterable(self.dicts)) != self.all_keys:
            return False
        if not all(map(operator.is_, itertools.chain.from_iterable(map(dict.values, self.dicts)), self.all_values)):
            return False
        if list(map(len, self.lists)) != self.list_sizes:
            return False
        if not all(map(operator.is_, itertools.chain.from_iterable(self.lists), self.list_items)):
            return False
        if not all(map(operator.is_, itertools.chain.from_iterable(map(_FLAGS, self.states)), self.flags)):
            return False
        return list(map(_METADATA, self.variables)) == self.metadata

    def leaves(self) -> list | None:
        """The variables' values now, or None where one is no longer a single leaf."""
        values = list(map(_RAW_VALUE, self.variables))
        return values if all(map(isinstance, values, itertools.repeat(_ARRAYS))) else None


_LOCK = threading.Lock()
_SEEN = "seen once"


@dataclasses.dataclass
class _Refused:
    """A model that could not be recorded: flattened on every call, tried again after `calls_left`."""

    calls_left: int


# id(model) -> (a weak reference to it, its state: _SEEN, a _Record or a _Refused). By identity:
# two models that compare equal are two entries. The weak reference's callback drops the entry.
_RECORDS: dict[int, tuple[weakref.ref, Any]] = {}
_STATS = {"flattens": 0, "kept": 0, "recorded": 0}


def _drop(key: int, ref: weakref.ref, records=_RECORDS) -> None:
    # A model freed: its entry goes. Without the lock: the callback can run inside any allocation,
    # on a thread that already holds it (a collection of a model in a reference cycle while `record`
    # writes the table), or at exit with the lock held by a frozen daemon thread. Should another
    # thread store an entry at the same id between the two lines, that entry is dropped: its model
    # is then met as for the first time, which is safe. The table is bound here: at interpreter
    # exit the module's globals may be gone first.
    entry = records.get(key)
    if entry is not None and entry[0] is ref:
        records.pop(key, None)


def record(model) -> _Record | None:
    """The model's record, checked against the model now (rebuilt if anything changed), or None
    where it is not kept (a first call, `KEEP` off, a model that cannot be recorded)."""
    if not KEEP:
        return None
    key = id(model)
    with _LOCK:
        entry = _RECORDS.get(key)
        if entry is not None and entry[0]() is not model:
            entry = None  # a dead model's id, reused before its callback ran
        if entry is None:  # the first call: remembered, not recorded
            try:
                _RECORDS[key] = (weakref.ref(model, lambda ref, key=key, drop=_drop: drop(key, ref)), _SEEN)
            except TypeError:  # a model that takes no weak reference
                pass
            return None
        ref, state = entry
        if isinstance(state, _Refused):
            state.calls_left -= 1
            if state.calls_left > 0:
                return None
    if isinstance(state, _Record) and state.holds(model):
        return state
    try:
        state = _Record(model)
    except _NotKept:
        state = _Refused(RETRY_AFTER)
    with _LOCK:
        _RECORDS[key] = (ref, state)
        _STATS["recorded"] += isinstance(state, _Record)
    return state if isinstance(state, _Record) else None


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
    return found, (jax.tree.structure(model), _sharing(found))


def _sharing(variables: list) -> tuple[int, ...]:
    """Each leaf's first position: a variable in two places (tied weights) is one variable."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(v), i) for i, v in enumerate(variables))


def stats() -> dict[str, int]:
    """Calls that flattened the model, calls that took it from its record, and records built."""
    with _LOCK:
        return dict(_STATS)


def forget() -> None:
    """Drop every record (the next call of each model flattens it)."""
    with _LOCK:
        _RECORDS.clear()
