"""Checkpoint fuzzing: a mutated file either raises `CheckpointError` or loads exactly the original.

Every mutation the format can suffer is generated: truncation at any byte, byte flips in the
header and in the data, a header length pointing past the end, a tensor claiming a huge shape
(up to hundreds of dimensions), duplicate keys, overlapping offsets, non-JSON metadata, a wrong
format version, and a hostile config (wrong types, out-of-range numbers, absurd sizes, missing
fields, deep nesting). Metadata and config mutations are resealed with a valid digest, so they
reach the checks they aim at instead of stopping at the digest. The loader must
answer each with `CheckpointError` (never another exception), without hanging and without a
large allocation before validation. A mutation that changes nothing the loader reads (e.g. a
JSON space turned into a newline) may load, but then it must load the original bit for bit.
"""

import json
import signal
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from conformance import CheckpointError, init_params, preset

from conformance.core import checkpoint
from conformance.core.checkpoint import _canonical_digest

CONFIG = preset("default", d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1, n_decoder_layers=1,
                src_vocab_size=6, tgt_vocab_size=6, max_len=4)
PARAMS = init_params(CONFIG, seed=0, dtype=np.float32)


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "good.safetensors"
    checkpoint.save(path, CONFIG, PARAMS)
    return path.read_bytes()


def split(data: bytes):
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n]), data[8 + n :]


def assemble(header: dict | bytes, body: bytes, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + body


def resealed(header: dict, body: bytes) -> bytes:
    """The file with its sha256 recomputed: a mutation of the metadata then reaches the format,
    version and config checks instead of stopping at the digest."""
    header["__metadata__"]["sha256"] = _canonical_digest(header, body)
    return assemble(header, body)


# Mutations: each takes the original bytes and a hypothesis `data` object.

def truncate(data, draw):
    return data[: draw(st.integers(0, len(data) - 1))]


def flip_header_byte(data, draw):
    n = struct.unpack("<Q", data[:8])[0]
    i = draw(st.integers(0, 8 + n - 1))
    return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]


def flip_data_byte(data, draw):
    n = struct.unpack("<Q", data[:8])[0]
    i = draw(st.integers(8 + n, len(data) - 1))
    return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]


def length_past_end(data, draw):
    n, _, _ = split(data)
    return struct.pack("<Q", draw(st.integers(len(data) - 7, 2**64 - 1))) + data[8:]


def huge_tensor(data, draw):
    _, header, body = split(data)
    name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    rank = draw(st.sampled_from([1, 2, 3, 64, 65, 300]))  # up to ranks no real tensor has
    header[name]["shape"] = [draw(st.integers(2**20, 2**64 - 1)) for _ in range(rank)]
    return assemble(header, body)


def duplicate_key(data, draw):
    _, header, body = split(data)
    name = draw(st.sampled_from(sorted(header)))
    raw = json.dumps(header).encode()
    entry = json.dumps({name: header[name]})[1:-1].encode()
    return assemble(raw[:-1] + b", " + entry + b"}", body)


def overlapping_offsets(data, draw):
    _, header, body = split(data)
    names = sorted(k for k in header if k != "__metadata__")
    name = draw(st.sampled_from(names[1:]))
    begin, end = header[name]["data_offsets"]
    shift = draw(st.integers(1, max(1, begin)))
    header[name]["data_offsets"] = [begin - shift, end - shift]
    return assemble(header, body)


def bad_metadata(data, draw):
    _, header, body = split(data)
    key = draw(st.sampled_from(["config", "format", "format_version", "sha256"]))
    header["__metadata__"][key] = draw(st.sampled_from(["{", "", "null", "[]", '{"d_model": "x"}', "2", "rosetta"]))
    return assemble(header, body) if key == "sha256" else resealed(header, body)


def wrong_version(data, draw):
    _, header, body = split(data)
    header["__metadata__"]["format_version"] = str(draw(st.integers(2, 10**6)))
    return resealed(header, body)


# Config values a hostile file may write: wrong types, numbers beyond float or int range, absurd
# sizes, deep nesting. Sealed with a valid digest, so only the config checks can refuse them.
HOSTILE_VALUES = st.one_of(
    st.sampled_from([None, "x", [], {}, True, -1, 0, 10**9, 10**12, 2**63, -(10**30), 1e300, -1e300, 0.5]),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)


def hostile_config(data, draw):
    _, header, body = split(data)
    config = json.loads(header["__metadata__"]["config"])
    how = draw(st.sampled_from(["value", "drop", "nest", "huge int"]))
    if how == "value":
        config[draw(st.sampled_from(sorted(config)))] = draw(HOSTILE_VALUES)
        text = json.dumps(config)
    elif how == "drop":
        del config[draw(st.sampled_from(sorted(config)))]
        text = json.dumps(config)
    elif how == "nest":
        text = "[" * draw(st.integers(1000, 100_000))
    else:
        text = json.dumps({**config, draw(st.sampled_from(sorted(config))): "BIG"}).replace(
            '"BIG"', "-" * draw(st.booleans()) + "9" * draw(st.integers(300, 4000)))
    header["__metadata__"]["config"] = text
    return resealed(header, body)


def garbage_header(data, draw):
    n, _, body = split(data)
    raw = draw(st.binary(min_size=1, max_size=64))
    return assemble(raw, body)


MUTATIONS = [truncate, flip_header_byte, flip_data_byte, length_past_end, huge_tensor, duplicate_key,
             overlapping_offsets, bad_metadata, wrong_version, hostile_config, garbage_header]


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang("checkpoint.load did not return within 10 s")


@settings(max_examples=max(500, settings().max_examples), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mutation=st.sampled_from(MUTATIONS), data=st.data())
def test_mutated_checkpoints_fail_cleanly(original, tmp_path, mutation, data):
    mutated = mutation(original, data.draw)
    path = tmp_path / "mutated.safetensors"
    path.write_bytes(mutated)
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)  # a guard against hangs, not a speed target
    tracemalloc.start()
    try:
        config, params = checkpoint.load(path)
    except CheckpointError as exc:
        assert str(path) in str(exc)
        peak = tracemalloc.get_traced_memory()[1]
        assert peak < 10 * len(original) + 1_000_000, f"{mutation.__name__}: {peak} bytes allocated before refusing"
        return
    finally:
        tracemalloc.stop()
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    # It loaded: then it must be the original, bit for bit. A resealed config that is valid (a
    # mask fill of -1, say) is a different but genuine checkpoint: its config must have passed
    # validation, and the parameters must still be the original ones.
    if mutation is hostile_config:
        config.validate()
    else:
        assert config == CONFIG, f"{mutation.__name__} loaded a different config"
    assert list(params) == list(PARAMS)
    for name in PARAMS:
        assert params[name].tobytes() == PARAMS[name].tobytes(), f"{mutation.__name__} changed {name!r}"


def test_every_mutation_kind_is_refused_at_least_once(original, tmp_path):
    """Guard against a mutation that never actually breaks anything (a fuzzer without teeth)."""
    from hypothesis import find

    for mutation in MUTATIONS:
        def refused(draw_data, mutation=mutation):
            path = tmp_path / f"{mutation.__name__}.safetensors"
            path.write_bytes(mutation(original, draw_data.draw))
            try:
                checkpoint.load(path)
            except CheckpointError:
                return True
            return False

        # No shrinking: any refused example answers the question (13 CPU-seconds with it, 3 without).
        find(st.data(), refused, settings=settings(max_examples=50, database=None, phases=[Phase.generate]))
