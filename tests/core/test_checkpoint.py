"""The checkpoint format: bit-exact round trips, strict loading, atomic saving, interoperability."""

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest

from conformance import CheckpointError, ModelConfig, init_params, preset

from conformance.core import checkpoint
from conformance.core.checkpoint import FORMAT_NAME, FORMAT_VERSION, read_tensors, write_tensors

CONFIG = preset("hf-marian", n_encoder_layers=1, n_decoder_layers=1, d_model=16, n_heads=2, d_ff=24,
                src_vocab_size=20, tgt_vocab_size=20, position="table", max_len=12)
DTYPES = [np.float64, np.float32, np.float16, ml_dtypes.bfloat16]


def params_of(dtype=np.float32, config=CONFIG):
    return init_params(config, seed=3, dtype=dtype)


def metadata(**changes):
    meta = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "config": CONFIG.to_json()}
    meta.update(changes)
    return meta


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_round_trip_is_bit_exact(tmp_path, dtype):
    params = params_of(dtype)
    path = tmp_path / "model.safetensors"
    checkpoint.save(path, CONFIG, params)
    config, loaded = checkpoint.load(path)
    assert config == CONFIG and config.notes == CONFIG.notes
    assert list(loaded) == list(params)  # forward order is kept
    for name, value in params.items():
        assert loaded[name].dtype == value.dtype, name
        assert loaded[name].tobytes() == value.tobytes(), name
    # Saving what was loaded gives the same file, byte for byte.
    again = tmp_path / "again.safetensors"
    checkpoint.save(again, config, loaded)
    assert again.read_bytes() == path.read_bytes()


def test_infinite_mask_fill_survives_the_file(tmp_path):
    config = CONFIG.replace(mask_fill=float("-inf"))
    checkpoint.save(tmp_path / "m.safetensors", config, params_of(config=config))
    assert checkpoint.load(tmp_path / "m.safetensors")[0].mask_fill == float("-inf")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_files_open_with_the_safetensors_library(tmp_path, dtype):
    from safetensors import safe_open

    params = params_of(dtype)
    path = tmp_path / "model.safetensors"
    checkpoint.save(path, CONFIG, params)
    framework = "pt" if dtype is ml_dtypes.bfloat16 else "numpy"
    with safe_open(str(path), framework=framework) as f:
        assert f.metadata()["format"] == FORMAT_NAME
        assert set(f.keys()) == set(params)
        name = "encoder.embedding.weight"
        value = f.get_tensor(name)
        if framework == "pt":
            value = value.view(__import__("torch").uint16).numpy().view(ml_dtypes.bfloat16)
        assert value.tobytes() == params[name].tobytes()


def test_files_written_by_the_safetensors_library_read_back(tmp_path):
    from safetensors.numpy import save_file

    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, dtype=np.int64)}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"k": "v"})
    meta, loaded = read_tensors(tmp_path / "x.safetensors")
    assert meta == {"k": "v"}
    for name in tensors:
        np.testing.assert_array_equal(loaded[name], tensors[name])


def expect_error(path, *words):
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(path)
    message = str(info.value)
    assert str(path) in message and info.value.path == str(path)
    for word in words:
        assert word in message, message
    return message


def test_missing_unexpected_wrong_shape_wrong_dtype(tmp_path):
    params = params_of()
    path = tmp_path / "m.safetensors"

    missing = dict(params)
    del missing["decoder.layers.0.ffn.linear2.bias"]
    write_tensors(path, missing, metadata())
    expect_error(path, "missing", "decoder.layers.0.ffn.linear2.bias")

    write_tensors(path, {**params, "extra.weight": np.zeros(3, np.float32)}, metadata())
    expect_error(path, "unexpected", "extra.weight")

    write_tensors(path, {**params, "output.bias": np.zeros(3, np.float32)} if "output.bias" in params else
                  {**params, "final_logits_bias": np.zeros(3, np.float32)}, metadata())
    expect_error(path, "shape")

    write_tensors(path, {**params, "final_logits_bias": np.zeros(20, np.int32)}, metadata())
    expect_error(path, "dtype", "int32")

    write_tensors(path, {**params, "final_logits_bias": np.zeros(20, np.float64)}, metadata())
    expect_error(path, "mix dtypes")


def test_bad_metadata(tmp_path):
    params = params_of()
    path = tmp_path / "m.safetensors"
    write_tensors(path, params, metadata(format="something-else"))
    expect_error(path, "unknown format")
    write_tensors(path, params, metadata(format_version="99"))
    expect_error(path, "format_version", "99")
    config = json.loads(CONFIG.to_json())
    config["n_heads"] = 3
    write_tensors(path, params, metadata(config=json.dumps(config)))
    expect_error(path, "invalid config", "n_heads")
    write_tensors(path, params, metadata(config="{not json"))
    expect_error(path, "invalid config", "JSON")
    write_tensors(path, params, {})
    expect_error(path, "unknown format")


def test_nonfinite_weights_are_refused(tmp_path):
    params = params_of()
    params["encoder.layers.0.ffn.linear1.weight"][0, 0] = np.nan
    path = tmp_path / "m.safetensors"
    write_tensors(path, params, metadata())
    expect_error(path, "NaN or infinite", "encoder.layers.0.ffn.linear1.weight")


def test_truncated_and_corrupt_files(tmp_path):
    good = tmp_path / "good.safetensors"
    checkpoint.save(good, CONFIG, params_of())
    data = good.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    cases = {
        "empty": b"",
        "short": data[:5],
        "cut_in_header": data[: 8 + n // 2],
        "cut_in_data": data[:-10],
        "trailing": data + b"\0" * 8,
        "zero_header": struct.pack("<Q", 0) + data[8:],
        "header_past_end": struct.pack("<Q", len(data)) + data[8:],
        "huge_header": struct.pack("<Q", 2**62) + data[8:],
        "not_json": data[:8] + b"[" * n + data[8 + n :],
        "flipped_data": data[:-3] + bytes([data[-3] ^ 0x40]) + data[-2:],
    }
    for name, content in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(content)
        message = expect_error(path)
        assert any(w in message for w in ("truncated", "corrupt")), (name, message)


def test_header_structure_problems(tmp_path):
    def raw(header: dict, data: bytes) -> bytes:
        text = json.dumps(header).encode()
        return struct.pack("<Q", len(text)) + text + data

    def check(name, header, data, *words):
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(raw(header, data))
        expect_error(path, *words)

    meta = metadata()
    check("overlap", {"__metadata__": meta, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "overlaps")
    check("gap", {"__metadata__": meta, "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "gap")
    check("huge_claim", {"__metadata__": meta, "a": {"dtype": "F32", "shape": [2**40, 2**20], "data_offsets": [0, 8]}},
          b"\0" * 8, "needs")
    check("bad_dtype", {"__metadata__": meta, "a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, b"\0" * 16, "unknown dtype")
    check("neg_shape", {"__metadata__": meta, "a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "invalid shape")
    check("past_end", {"__metadata__": meta, "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "outside")
    check("meta_not_str", {"__metadata__": {"format": 1}}, b"", "__metadata__")
    check("entry_keys", {"__metadata__": meta, "a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, "data_offsets")
    # Duplicate keys: json.loads would silently keep the last one.
    text = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}'
    path = tmp_path / "dup.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 4)
    expect_error(path, "duplicate key")


def test_high_rank_claims_are_refused_without_big_integers(tmp_path):
    """A shape of hundreds of 2**62 dimensions once built a 20000-digit product (and then failed
    to format it); the product is now bounded by the data section as it is multiplied."""
    def check(name, shape, *words):
        header = {"__metadata__": metadata(), "a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 8]}}
        text = json.dumps(header).encode()
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * 8)
        message = expect_error(path, *words)
        assert len(message) < 1000, "the message quotes a bounded part of the shape"

    check("rank300", [2**62] * 300, "invalid shape", "at most 64")
    check("rank64", [2**62] * 64, "needs more bytes than the whole 8-byte data section")
    check("zero_dim", [2**62, 0], "needs 0 bytes, offsets give 8")  # a zero dimension: 0 bytes, exactly


# A config as a hostile file may write it: each with a valid digest and the parameters of the
# config it alters, so that only the config checks stand between it and a model (whose sinusoid
# table, for one, has max_len rows). Each must be a CheckpointError naming the file.
SINUSOID = CONFIG.replace(position="sinusoid-split")


def _config_with(**changes):
    data = json.loads(SINUSOID.to_json())
    data.update(changes)
    return json.dumps(data)


HOSTILE_CONFIGS = {
    "notes not a mapping": (_config_with(notes=5), "notes"),
    "notes a string": (_config_with(notes="ab"), "notes"),
    "integer fill beyond float": (_config_with(mask_fill="X").replace('"X"', "-1" + "0" * 400), "mask_fill"),
    "nested a hundred thousand deep": ("[" * 100_000, "not valid JSON"),
    "a field missing": (json.dumps({k: v for k, v in json.loads(SINUSOID.to_json()).items() if k != "norm_placement"}),
                        "norm_placement", "missing"),
    "a billion layers": (_config_with(n_encoder_layers=10**9), "calls for", "parameters"),
    "a trillion positions": (_config_with(max_len=10**12), "max_len", "exceeds"),
    "fill below float32": (_config_with(mask_fill=-1e300), "mask_fill", "float32"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_CONFIGS))
def test_hostile_configs_are_checkpoint_errors(tmp_path, name):
    text, *words = HOSTILE_CONFIGS[name]
    path = tmp_path / "m.safetensors"
    write_tensors(path, params_of(config=SINUSOID), metadata(config=text))
    expect_error(path, *words)


def test_a_foreign_file_is_refused_before_its_data_is_read(tmp_path):
    """The header tells the format, version, config and parameter set: a file that fails any of
    them is refused without reading (or allocating) its data section."""
    import tracemalloc

    path = tmp_path / "big.safetensors"
    write_tensors(path, {"weight": np.zeros((2048, 2048), np.float32)}, {"format": "someone-else"})  # 16 MiB
    config_json = CONFIG.to_json()
    wrong_set = tmp_path / "wrong-set.safetensors"
    write_tensors(wrong_set, {"weight": np.zeros((2048, 2048), np.float32)}, metadata(config=config_json))
    for target, words in ((path, ("unknown format",)), (wrong_set, ("missing",))):
        tracemalloc.start()
        try:
            expect_error(target, *words)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1_000_000, f"{peak} bytes allocated to refuse {target.name}"


def test_saving_onto_a_directory_or_into_a_missing_one_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="is a directory"):
        checkpoint.save(tmp_path, CONFIG, params_of())
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.save(tmp_path / "absent" / "m.safetensors", CONFIG, params_of())
    assert list(tmp_path.iterdir()) == [], "no temporary file is left behind"


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_saving_under_another_suffix_is_refused(tmp_path, backend):
    """`impl_*.save(model, "x.pt")` wrote safetensors bytes under a name every tool reads as
    PyTorch's (`rosetta inspect x.pt` then refused it): the name must say .safetensors."""
    from conformance.check import backends

    module = backends.import_backend(backend)
    model = module.Model(CONFIG, params_of())
    for name in ("x.pt", "x", "x.safetensors.bak"):
        with pytest.raises(CheckpointError, match=r"\.safetensors file; name it \*\.safetensors"):
            module.save(model, tmp_path / name)
    assert list(tmp_path.iterdir()) == []
    module.save(model, tmp_path / "x.SafeTensors")
    assert checkpoint.load(tmp_path / "x.SafeTensors")[0] == CONFIG


def test_not_a_file(tmp_path):
    expect_error(tmp_path / "absent.safetensors", "no such file")
    expect_error(tmp_path, "directory")


def test_save_refuses_params_that_do_not_fit(tmp_path):
    params = params_of()
    del params["encoder.embedding.weight"]
    with pytest.raises(CheckpointError, match="missing"):
        checkpoint.save(tmp_path / "m.safetensors", CONFIG, params)
    ragged = {**params_of(), "encoder.layers.0.ffn.linear1.bias": [[0.0, 1.0], [2.0]]}
    with pytest.raises(CheckpointError, match="'encoder.layers.0.ffn.linear1.bias' is not a rectangular array"):
        checkpoint.save(tmp_path / "m.safetensors", CONFIG, ragged)
    assert not (tmp_path / "m.safetensors").exists()
    assert os.listdir(tmp_path) == []


def test_save_replaces_atomically_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    checkpoint.save(path, CONFIG, params_of())
    before = path.read_bytes()

    # An interruption after part of the new file is written: the old file must be intact.
    real_fsync = os.fsync

    def crash(fd):
        raise KeyboardInterrupt("simulated interruption mid-save")

    monkeypatch.setattr(os, "fsync", crash)
    other = CONFIG.replace(layer_norm_eps=1e-6)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(path, other, params_of(np.float64))
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)


def test_model_config_in_file_is_plain_json(tmp_path):
    path = tmp_path / "m.safetensors"
    checkpoint.save(path, CONFIG, params_of())
    meta, _ = read_tensors(path)
    assert ModelConfig.from_dict(json.loads(meta["config"])) == CONFIG
    assert len(meta["sha256"]) == 64
