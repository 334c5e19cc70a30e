"""Checkpoint files: atomic against a kill mid-write, clear errors on bad files."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ashl import checkpoint

WRITER = """
import sys, torch
from ashl import checkpoint
path = sys.argv[1]
n = 0
while True:   # rewrite a large checkpoint until killed
    n += 1
    checkpoint.atomic_save({"format": checkpoint.FORMAT, "n": n,
                            "model": torch.full((2_000_000,), float(n))}, path)
    print(n, flush=True)
"""


def test_a_kill_mid_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    path = tmp_path / "ckpt"
    kills = 0
    for delay in (0.05, 0.13, 0.21, 0.34, 0.55):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)],
                                stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()            # one checkpoint is complete
        time.sleep(delay)                 # then kill it somewhere in a later write
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        saved = checkpoint.load(str(path))
        assert saved["n"] >= 1
        assert torch.equal(saved["model"], torch.full((2_000_000,), float(saved["n"])))
    assert kills == 5
    # A write takes almost all of each loop: at least one kill landed mid-write and left its
    # temporary file behind, never a torn checkpoint.
    assert list(tmp_path.glob("ckpt.tmp*"))


def test_missing_and_foreign_files_get_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint.load(str(tmp_path / "nope"))
    garbage = tmp_path / "garbage"
    garbage.write_bytes(os.urandom(1000))
    with pytest.raises(ValueError, match="not readable"):
        checkpoint.load(str(garbage))
    foreign = tmp_path / "foreign"
    torch.save({"weights": 1}, foreign)
    with pytest.raises(ValueError, match="not an ashl checkpoint"):
        checkpoint.load(str(foreign))
    with pytest.raises(FileNotFoundError, match="directory"):
        checkpoint.atomic_save({"format": checkpoint.FORMAT}, str(tmp_path / "no" / "ckpt"))
