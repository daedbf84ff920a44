"""`rosetta convert SRC DST`: a foreign checkpoint in, a rosetta checkpoint out (with --to LAYOUT, the other way)."""

from __future__ import annotations

import argparse
import sys

HELP = ("Convert a foreign checkpoint (.safetensors, .pt/.pth/.bin state dict, .npz, Flax .msgpack, an Orbax or "
        "PyTorch Distributed Checkpoint directory) into a rosetta checkpoint, "
        "choosing the layout by its keys unless --layout is given.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="the foreign weights file, Orbax directory or Hugging Face model folder (never modified)")
    parser.add_argument("dst", help="the rosetta checkpoint to write (.safetensors; written beside it, checked, and "
                                    "renamed into place only then)")
    parser.add_argument("--layout", metavar="NAME|FILE", help="a built-in layout (see `rosetta layouts`) or a layout TOML file; default: auto-detect")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a ModelConfig field the tensors cannot tell or that your copy of the system changed, e.g. n_heads=8 (repeatable)")
    parser.add_argument("--dtype", choices=["float64", "float32", "float16", "bfloat16"], help="cast every parameter (default: keep the stored dtype)")
    parser.add_argument("--to", metavar="LAYOUT", help="the other direction: SRC is a rosetta checkpoint, DST the "
                        "foreign file in LAYOUT's key space (.safetensors, .pt/.pth/.bin for a PyTorch state dict of "
                        "tensors, .msgpack for Flax's msgpack, or a "
                        "new directory: for a Hugging Face layout (hf-marian, hf-bart, ...) a model folder that its "
                        "from_pretrained loads, otherwise an Orbax checkpoint); `--to dcp` / `--to orbax`: a new "
                        "PyTorch Distributed Checkpoint / Orbax directory in rosetta's own names, which "
                        "impl_torch.load_distributed / impl_jax.load_sharded read onto any mesh")
    parser.add_argument("--taps", action="store_true",
                        help="with --to onnx: add the tensors `rosetta check` compares (embeddings, attention weights, "
                             "each sublayer's output) to the graphs as outputs of those names")
    parser.add_argument("--quantization", choices=["float32", "int8", "int8_float32", "bfloat16", "float16"],
                        help="with --to ctranslate2: the type CTranslate2 stores the weights in (its names; default "
                             "float32), its default compute type when loaded (docs/deployment.md)")
    parser.add_argument("--key", metavar="NAME", help="the entry of a PyTorch file that holds the state dict (e.g. model), or the dotted path of the parameter tree in a Flax msgpack file or Orbax checkpoint (e.g. params)")
    parser.add_argument("--force", action="store_true",
                        help="replace DST if it exists (a file only, never a directory; the new file is written beside it "
                             "and renamed over it once complete, so an interrupted run leaves the old one)")
    parser.add_argument("--rename", dest="renames", action="append", default=[], metavar="OLD=NEW",
                        help="rename a key prefix before matching a layout, e.g. embed_src.=src_tok_emb.embedding. "
                             "(repeatable): your own wrapper, a built-in layout, no layout file")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="do not check what was written (by default the output is loaded by what will read it: "
                             "our loader, transformers, ONNX Runtime, CTranslate2, torch DCP or Orbax, and compared "
                             "with the float64 oracle on 3 padded rows before it is renamed into place; a divergence "
                             "exits 1 and leaves nothing); the output says that it was not verified")


# The flags' parsers live with the formats that use them; `rosetta compare` reads --set with the same one.
from conformance.formats.base import parse_renames, parse_sets  # noqa: E402


def options(args: argparse.Namespace):
    """The flags of `rosetta convert` as `conformance.formats.Options`."""
    from conformance.formats import Options

    return Options(layout=args.layout, sets=tuple(args.sets), renames=tuple(args.renames), key=args.key,
                   dtype=args.dtype, to=getattr(args, "to", None), taps=getattr(args, "taps", False),
                   quantization=getattr(args, "quantization", None), force=getattr(args, "force", False),
                   verify=getattr(args, "verify", True))


def run(args: argparse.Namespace) -> int:
    """Parse the flags and hand them to `conformance.formats.convert`, which picks the input's and
    the output's formats from its registry, writes, checks and renames into place; print what it did.
    A check that fails is exit status 1 (nothing written); a refusal, 2."""
    from conformance.cli.progress import Status
    from conformance.convert.engine import CastOverflowError
    from conformance.core.errors import VerificationError
    from conformance.formats import convert

    status = Status("rosetta convert")
    try:
        with status:
            done = convert(args.src, args.dst, options(args), progress=status)
    except CastOverflowError as exc:
        raise flagged(exc) from None
    except VerificationError as exc:
        print(f"rosetta convert: error: {exc}", file=sys.stderr)
        return 1
    for line in done.lines:
        print(line)
    for problem in done.warnings:
        print(f"rosetta convert: warning: {problem}", file=sys.stderr)
    return 0


def flagged(error: Exception) -> Exception:
    """A cast's overflow as the command line asked for it: with the --dtype flag the user typed."""
    from conformance.convert.engine import CastOverflowError
    from conformance.convert.errors import TensorError

    if isinstance(error, CastOverflowError):
        return TensorError(error.key, f"{error.problem} than --dtype {error.dtype}")
    return error
