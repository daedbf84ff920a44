"""Saving over an existing checkpoint is atomic: a killed or concurrent save never tears the file.

Two checks, each with a child process that saves a different large model over the same path:
1. The child is stopped at the worst moment (every byte of the new file written and flushed,
   the rename not yet done) and killed with SIGKILL: the old file must load unchanged.
2. The child saves in a loop while this process keeps loading the file: every load must
   succeed and give one of the two models, never a torn or truncated mixture.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conformance.core import checkpoint

from conformance import init_params, preset

SIZES = dict(d_model=256, n_heads=4, d_ff=1024, src_vocab_size=4000, tgt_vocab_size=4000)

CHILD = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    from conformance.core import checkpoint
    from conformance import init_params, preset

    path, mode = sys.argv[1], sys.argv[2]
    config = preset("default", **{sizes!r}).replace(layer_norm_eps=1e-6)
    params = init_params(config, seed=1, dtype=np.float32)
    if mode == "pause":
        real_fsync = os.fsync
        def fsync_then_wait(fd):
            real_fsync(fd)
            print("flushed", flush=True)  # the new bytes are on disk; the rename has not happened
            time.sleep(60)
        os.fsync = fsync_then_wait
    print("ready", flush=True)
    while True:
        checkpoint.save(path, config, params)
    """
).replace("{sizes!r}", repr(SIZES))


def old_model(tmp_path):
    path = tmp_path / "model.safetensors"
    config = preset("default", **SIZES)
    params = init_params(config, seed=0, dtype=np.float32)
    checkpoint.save(path, config, params)
    assert path.stat().st_size > 20_000_000  # large enough that a save takes a while
    return path, path.read_bytes()


def start(path, mode):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), mode], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


def test_save_killed_before_the_rename_leaves_the_old_file(tmp_path):
    path, before = old_model(tmp_path)
    child = start(path, "pause")
    try:
        line = child.stdout.readline().strip()
        assert line == "flushed", f"the save never reached the point of having written its data: {line!r}"
        assert path.read_bytes() == before, "the destination changed before the save finished"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert path.read_bytes() == before
    checkpoint.load(path)
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "model.safetensors"]
    # A killed writer leaves its private temporary file beside the target (cleaning it up
    # needs the process that was killed); never a damaged target.
    assert leftovers and all(name.startswith(".model.safetensors.tmp-") for name in leftovers), leftovers


def test_concurrent_readers_never_see_a_torn_file(tmp_path):
    path, _ = old_model(tmp_path)
    child = start(path, "loop")
    seen = set()
    try:
        deadline = time.monotonic() + 4.0
        loads = 0
        while time.monotonic() < deadline:
            config, params = checkpoint.load(path)  # raises CheckpointError on a torn file
            seen.add(config.layer_norm_eps)
            loads += 1
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert loads >= 5
    assert seen <= {1e-5, 1e-6}
    config, params = checkpoint.load(path)
    assert config.layer_norm_eps in (1e-5, 1e-6)


def test_a_second_ctrl_c_during_the_cleanup_still_removes_the_hidden_directory(tmp_path, monkeypatch):
    """Ctrl-C while a directory is written removes its hidden temporary directory; a second Ctrl-C
    that arrives while that removal runs is held until it ends, then raised: nothing is left
    beside the destination, half-removed or whole."""
    import shutil

    from conformance.core import checkpoint

    real_rmtree = shutil.rmtree
    interrupted = []

    def interrupted_rmtree(path, *args, **kwargs):  # the user presses Ctrl-C again, mid-cleanup
        os.kill(os.getpid(), signal.SIGINT)
        interrupted.append(path)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", interrupted_rmtree)
    target = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with checkpoint.atomic_directory(target) as staged:
            staged.mkdir()
            (staged / "weights.bin").write_bytes(b"x" * 1024)
            raise KeyboardInterrupt  # the first Ctrl-C, while writing
    assert interrupted, "the cleanup did not run"
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
