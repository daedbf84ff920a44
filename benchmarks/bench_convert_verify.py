"""What checking an output costs beside writing it: `rosetta convert` with and without its check.

    python benchmarks/bench_convert_verify.py                   # the default model and a tiny Marian, 3 rounds
    python benchmarks/bench_convert_verify.py --model base      # a base-size Marian (d_model 512, 6+6 layers)
    python benchmarks/bench_convert_verify.py --paths resave,dcp --rounds 5

Two measurements, each path's runs interleaved with the other paths' in every round (so a machine
that slows down slows both sides alike):

    in process  `conformance.formats` called as `rosetta convert` calls it, with the imports already
                paid: the conversion (read, write, trial forward pass) and the check of what was
                written (`Format.verify` + `verify_source`), timed apart in the same call
    command     `rosetta convert` in a fresh process, with and without --no-verify, one after the
                other: what a user waits, imports included (the check imports transformers,
                ONNX Runtime, CTranslate2 or JAX where the conversion did not)

The default model is the built-in conformance/check/data/default.safetensors (ModelConfig's own
switches: no Hugging Face family expresses it, so --to hf-marian and --to ctranslate2 run on the
tiny Marian of `ctranslate2_check.example_model`, its "default-size" stand-in). Medians over the
rounds; the ratio is check / conversion.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT = ROOT / "conformance" / "check" / "data" / "default.safetensors"
# name -> (the input: "default" or "marian", the output's name, rosetta convert's flags)
PATHS = {
    "resave": ("default", "copy.safetensors", []),
    "dcp": ("default", "dcp", ["--to", "dcp"]),
    "orbax": ("default", "orbax", ["--to", "orbax"]),
    "onnx": ("default", "graphs", ["--to", "onnx"]),
    "hf-marian": ("marian", "folder", ["--to", "hf-marian"]),
    "import-folder": ("marian-folder", "back.safetensors", []),
    "ctranslate2": ("marian", "ct2", ["--to", "ctranslate2"]),
}


def make_marian(root: Path, base: bool) -> tuple[Path, Path]:
    """A Marian checkpoint (tiny, or base-size: d_model 512, 8 heads, FFN 2048, 6+6 layers, vocabulary
    32000, 61 M float32 parameters) and its Hugging Face folder."""
    from conformance.check.ctranslate2 import target
    from conformance.core import checkpoint
    from conformance.formats import Options, convert

    if base:
        from conformance.core.params import init_params
        from conformance.core.presets import preset

        vocab = 32000
        config = preset("hf-marian", src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=512, n_heads=8, d_ff=2048,
                        n_encoder_layers=6, n_decoder_layers=6, max_len=512, pad_id=vocab - 1,
                        notes={"generation": json.dumps({"decoder_start_token_id": vocab - 1, "eos_token_id": 0,
                                                         "pad_token_id": vocab - 1})})
        params = {k: np.asarray(v, np.float32) for k, v in init_params(config, seed=0).items()}
        params["encoder.embedding.weight"][vocab - 1] = 0.0
    else:
        config, params = target.example_model(seed=0)
    path = root / "marian.safetensors"
    checkpoint.save(path, config, params)
    convert(path, root / "marian-folder", Options(to="hf-marian", verify=False))
    return path, root / "marian-folder"


def make_default(root: Path, base: bool) -> Path:
    """The built-in default model, or with --model base a base-size one of its switches (the paper's
    base: d_model 512, 8 heads, FFN 2048, 6+6 layers, a shared vocabulary of 32000)."""
    if not base:
        return DEFAULT
    from conformance.core import checkpoint
    from conformance.core.params import init_params

    config, _ = checkpoint.load(DEFAULT)
    config = config.replace(src_vocab_size=32000, tgt_vocab_size=32000, d_model=512, n_heads=8, d_ff=2048,
                            n_encoder_layers=6, n_decoder_layers=6, max_len=512)
    params = {k: np.asarray(v, np.float32) for k, v in init_params(config, seed=0).items()}
    path = root / "default-base.safetensors"
    checkpoint.save(path, config, params)
    return path


def in_process(src: Path, dst: Path, argv: list[str]) -> tuple[float, float]:
    """(conversion seconds, check seconds) of one `formats.convert`, the check timed inside it."""
    from conformance.cli import build_parser
    from conformance.cli.convert import options
    from conformance import formats

    args = build_parser().parse_args(["convert", str(src), str(dst), *argv])
    try:  # the ONNX export keeps the graphs of the last checkpoints it traced: each run pays its own
        from conformance.check.onnx import export as onnx_export

        onnx_export.EXPORTS.clear()
    except ImportError:
        pass
    checking = [0.0]
    originals = {}
    for cls in {type(f) for f in formats.FORMATS}:
        for method in ("verify", "verify_source"):
            if method in vars(cls):
                originals[(cls, method)] = vars(cls)[method]
    for (cls, method), original in originals.items():
        def timed(self, *a, _original=original, **k):
            started = time.perf_counter()
            try:
                return _original(self, *a, **k)
            finally:
                checking[0] += time.perf_counter() - started
        setattr(cls, method, timed)
    try:
        started = time.perf_counter()
        formats.convert(src, dst, options(args))
        total = time.perf_counter() - started
    finally:
        for (cls, method), original in originals.items():
            setattr(cls, method, original)
    return total - checking[0], checking[0]


def command(src: Path, dst: Path, argv: list[str], verify: bool) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "conformance.cli", "convert", str(src), str(dst), *argv,
                           *([] if verify else ["--no-verify"])], capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise SystemExit(f"rosetta convert {src} {dst} {' '.join(argv)} failed:\n{done.stderr}")
    return time.perf_counter() - started


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["default", "base"], default="default")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"some of {','.join(PATHS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-command", action="store_true", help="the in-process measurement only")
    args = parser.parse_args()
    paths = [p for p in args.paths.split(",") if p]
    base = args.model == "base"
    root = Path(tempfile.mkdtemp(prefix="bench-convert-verify-"))
    try:
        inputs = {"default": make_default(root, base)}
        inputs["marian"], inputs["marian-folder"] = make_marian(root, base)
        inside = {p: ([], []) for p in paths}
        outside = {p: ([], []) for p in paths}
        for path in paths:  # a first run of each pays the imports: not counted
            source, name, argv = PATHS[path]
            in_process(inputs[source], root / name, argv)
            remove(root / name)
        for _ in range(args.rounds):
            for path in paths:
                source, name, argv = PATHS[path]
                convert_s, check_s = in_process(inputs[source], root / name, argv)
                remove(root / name)
                inside[path][0].append(convert_s)
                inside[path][1].append(check_s)
                if not args.no_command:
                    for verify in (False, True):
                        outside[path][verify].append(command(inputs[source], root / name, argv, verify))
                        remove(root / name)
        print(f"model: {args.model}; {args.rounds} rounds, medians, seconds; CPU; python {sys.version.split()[0]}")
        print("| path | conversion (in process) | check (in process) | check / conversion | command --no-verify | "
              "command | command ratio |")
        print("|---|---|---|---|---|---|---|")
        for path in paths:
            c, v = statistics.median(inside[path][0]), statistics.median(inside[path][1])
            row = f"| {path} | {c:.3f} | {v:.3f} | {v / c:.2f}x |"
            if not args.no_command:
                plain, checked = statistics.median(outside[path][False]), statistics.median(outside[path][True])
                row += f" {plain:.2f} | {checked:.2f} | {checked / plain:.2f}x |"
            else:
                row += " - | - | - |"
            print(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
