"""What every format is and gives: the `Format` a module of conformance/formats/ defines, the
parsed flags of `rosetta convert` (`Options`), what a read and a write give back (`Read`,
`Written`), and `staged`: the destination built beside itself, checked, and renamed into place.

A format is an object with a name and up to seven methods, each with a default that says the
format does not do it:

    recognises(path)                      whether `path` is this format, as an input
    writes(options, dst)                  whether this format writes `dst` for these flags
    check_output(src, dst, options)       refuse flags and destinations before any work
    check_input(src, dst, options)        refuse flags that do not apply to this input
    read(src, options, progress) -> Read  config and parameters (or a streamed source)
    write(staged, read, options, dst)     write the output at `staged` (a path beside dst)
    verify(staged, read, options)         the output loaded by what will read it, beside the
                                          float64 oracle: a list of `verify.Verdict`s
    verify_source(src, read, options)     the input run by its own system, where one exists

May import what `conformance.formats` may (core, convert, check; backends lazily).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from conformance.core.config import ModelConfig

Progress = Callable[[str], None]


def parse_sets(items) -> dict[str, Any]:
    """`["n_heads=8", "mask_fill=-inf"]` -> `{"n_heads": 8, "mask_fill": -inf}`, typed by ModelConfig.

    A field given twice must be given the same value both times (`true` and `1` are the same bool);
    otherwise which one wins would be an accident of argument order."""
    from conformance.convert.errors import KIND_WORDS
    from conformance.core.errors import ConfigError

    types = {f.name: f.type for f in dataclasses.fields(ModelConfig) if f.name != "notes"}
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name, text = name.strip(), text.strip()
        if not sep or not name:
            raise ConfigError(name or item, f"--set {item!r} must look like KEY=VALUE")
        if name not in types:
            raise ConfigError(name, "is not a ModelConfig field (--set)")
        kind = types[name]
        try:
            if kind == "bool":
                lowered = text.lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                value = lowered in ("true", "1", "yes")
            elif kind == "int":
                value = int(text)
            elif kind == "float":
                value = float(text)
            else:
                value = text
        except ValueError:
            raise ConfigError(name, f"--set {name}={text!r}: expected {KIND_WORDS[kind]}") from None
        if name in out and repr(out[name]) != repr(value):  # repr: NaN is NaN, and 1e-5 is 0.00001
            raise ConfigError(name, f"given twice with different values: --set {name}={spelled[name]} and "
                              f"--set {name}={text}; give it once")
        out[name], spelled[name] = value, text
    return out


def parse_renames(items) -> dict[str, str]:
    """`["embed_src.=src_tok_emb.embedding."]` -> `{"embed_src.": "src_tok_emb.embedding."}`."""
    from conformance.core.errors import InputError

    out: dict[str, str] = {}
    for item in items:
        old, sep, new = item.partition("=")
        if not sep or not old:
            raise InputError("--rename", f"{item!r} must look like OLD=NEW (a key prefix and its new name)")
        if old in out and out[old] != new:
            raise InputError("--rename", f"{old!r} is renamed twice ({out[old]!r} and {new!r}); give it once")
        out[old] = new
    return out


@dataclass(frozen=True)
class Options:
    """The flags of `rosetta convert`, as given: `sets` and `renames` are parsed when a format
    uses them (`overrides()`, `rename_map()`), so that a format that takes none refuses them by
    name before their values are read."""

    layout: str | None = None
    sets: tuple[str, ...] = ()
    renames: tuple[str, ...] = ()
    key: str | None = None
    dtype: str | None = None
    to: str | None = None
    taps: bool = False
    quantization: str | None = None
    force: bool = False
    verify: bool = True

    FLAGS = ("layout", "sets", "renames", "key", "force", "dtype", "taps", "quantization")
    SPELLED = {"sets": "--set", "renames": "--rename"}

    def given(self, *names: str) -> list[str]:
        """The flags among `names` (attribute names) that were given, spelled as typed (`--set`)."""
        return [self.SPELLED.get(name, f"--{name}") for name in names if getattr(self, name)]

    def overrides(self) -> dict[str, Any]:
        return parse_sets(self.sets)

    def rename_map(self) -> dict[str, str]:
        return parse_renames(self.renames)


@dataclass
class Read:
    """What a format read: the config, the parameters (None when they are read one at a time from
    `source`, a `conformance.convert.sharded.Source`), and what `rosetta convert` says of them:
    `lines` after "SRC -> DST" and before the config, `warnings` on stderr, `counts` (say how
    many parameters), `trial` (run the trial forward pass), `layout` (the layout read through)."""

    config: ModelConfig
    params: dict | None
    source: Any = None
    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    counts: bool = False
    trial: bool = False
    layout: Any = None
    total: int | None = None  # the values written, when known only once written (a streamed source)
    # Each parameter as the source holds it, read again apart from the path that wrote it (its own
    # library, a reference cast): what the written file is checked against, where the conversion's
    # own parameters would only check the writer against its own input (a re-save, a sharded import).
    reference: Callable[[str], Any] | None = None


@dataclass
class Written:
    """What a format wrote: `title`, said in parentheses after "SRC -> DST"; `lines` after it
    (before the config); `warnings` on stderr."""

    title: str = ""
    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


class Format:
    """A checkpoint format: see the module's docstring. Every method's default says the format
    does not do that, so a format defines only what it does."""

    name = "format"

    def recognises(self, path: Path) -> bool:
        return False

    def writes(self, options: Options, dst: Path) -> bool:
        return False

    def check_output(self, src: Path, dst: Path, options: Options) -> None:
        return None

    def check_input(self, src: Path, dst: Path, options: Options) -> None:
        return None

    def read(self, src: Path, options: Options, progress: Progress) -> Read:
        raise NotImplementedError(f"{self.name} is not read by rosetta convert")

    def write(self, staged: Path, read: Read, options: Options, dst: Path) -> Written:
        raise NotImplementedError(f"{self.name} is not written by rosetta convert")

    def verify(self, staged: Path, read: Read, options: Options, progress: Progress) -> list:
        from conformance.formats.verify import not_run

        return [not_run(f"{self.name} has no check of what it writes")]

    def verify_source(self, src: Path, read: Read, options: Options, progress: Progress) -> list:
        return []


def check_new_directory(dst: Path, what: str) -> None:
    """Refuse a directory output that exists or whose parent does not; `what` says what goes there
    ("a CTranslate2 model goes")."""
    from conformance.core.errors import CheckpointError

    if dst.exists():
        raise CheckpointError(dst, f"already exists; {what} into a new directory: name one that does not exist")
    if not dst.parent.is_dir() and str(dst.parent):
        raise CheckpointError(dst, f"directory {dst.parent} does not exist")


def check_destination(dst: Path, force: bool) -> None:
    """Refuse, before any work, an output that exists (unless `force`) or whose directory cannot
    be written: said after a long conversion, either would waste it."""
    from conformance.core.errors import CheckpointError

    if dst.exists() and not force:
        raise CheckpointError(dst, "already exists; pass --force to replace it (the new file is written beside it "
                              "and renamed over it only once complete)")
    parent = dst.parent if str(dst.parent) else Path(".")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(dst, f"cannot write: permission denied on the directory {str(parent)!r}")


@contextlib.contextmanager
def conversion_warnings() -> Iterator[list]:
    """Records, every time, the padding and generation warnings a conversion gives (what
    `conversion_read` says of them)."""
    from conformance.convert.engine import PaddingWarning
    from conformance.core.generation.note import GenerationWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PaddingWarning)
        warnings.simplefilter("always", GenerationWarning)
        yield caught


def conversion_read(result, caught) -> Read:
    """A `conformance.convert.Conversion` as `rosetta convert` says it: its decisions, and the
    padding and generation warnings recorded while it ran (said on stderr)."""
    from conformance.convert.engine import PaddingWarning
    from conformance.core.generation.note import GenerationWarning

    lines = [line for line in result.decisions if not line.startswith(("WARNING:", "generation warning:"))]  # on stderr
    said = [str(w.message) for w in caught if issubclass(w.category, (PaddingWarning, GenerationWarning))]
    return Read(result.config, result.params, lines=lines, warnings=said, counts=True, trial=True,
                layout=result.layout)


def check_export(src: Path, dst: Path, options: Options) -> None:
    """What every `--to LAYOUT` export refuses before any work: flags that do not apply, the
    input as output, an existing directory, a missing parent, an existing file without --force."""
    from conformance.convert import load_layout
    from conformance.core.errors import CheckpointError, InputError

    if options.quantization:
        raise InputError("--quantization", "chooses how CTranslate2 stores the weights: give it with --to ctranslate2")
    if options.taps:
        raise InputError("--taps", "adds graph outputs to an ONNX export: give it with --to onnx")
    given = options.given("layout", "renames", "key", "dtype")
    if given:
        raise InputError(given[0], f"--to {options.to} writes a rosetta checkpoint's weights as stored, in layout "
                         f"{options.to}'s names: nothing to choose, rename, select or cast (convert with --dtype first "
                         "to cast)")
    load_layout(options.to)  # an unknown name is said before anything else
    suffix = dst.suffix.lower()
    if dst.exists() and src.exists() and os.path.samefile(src, dst):
        raise CheckpointError(dst, "is the input file; converting never overwrites its input")
    if dst.is_dir() or (dst.exists() and suffix == ""):
        raise CheckpointError(dst, "already exists; a directory is never replaced: name a new one")
    if not dst.parent.is_dir() and str(dst.parent):
        raise CheckpointError(dst, f"directory {dst.parent} does not exist")


@contextlib.contextmanager
def staged(dst: Path) -> Iterator[Path]:
    """A path for the output, `.NAME.tmp-XXXX/NAME` beside `dst`: the writer writes there, the
    check runs there, and only once both are done is it renamed to `dst` (over an existing file:
    `--force`). A failed check, an error or Ctrl-C at any point removes the hidden directory and
    everything in it, so `dst` is left as it was (`checkpoint.atomic_directory`). An error about
    the hidden path is said of `dst`: the temporary name is ours, not the user's."""
    from conformance.core.checkpoint import atomic_directory

    with atomic_directory(dst) as path:
        try:
            yield path
        except (OSError, ValueError) as exc:
            raise said_of(exc, path, dst) from None


def said_of(exc: Exception, staged_path: Path, dst: Path) -> Exception:
    """`exc` with the staged path (and its hidden directory) replaced by `dst` in what it names."""
    from conformance.core.errors import CheckpointError, InputError, VerificationError

    hidden = str(staged_path.parent)

    def named(text: str) -> str:
        return text.replace(str(staged_path), str(dst)).replace(hidden, str(dst.parent) if str(dst.parent) else ".")

    if isinstance(exc, OSError) and exc.filename and str(exc.filename).startswith(hidden):
        return type(exc)(exc.errno, exc.strerror, os.fspath(dst))
    if isinstance(exc, VerificationError):
        return VerificationError(dst, named(exc.problem), exc.verdicts)
    if isinstance(exc, CheckpointError) and exc.path.startswith(hidden):
        return CheckpointError(dst, named(exc.problem))
    if isinstance(exc, InputError) and hidden in str(exc):
        return InputError(named(exc.argument), named(exc.problem))
    return exc
