"""Hostfiles are checked before a launch, with one error line naming the file and line."""
import subprocess
import sys
from pathlib import Path

import pytest

from ashl.hostfile import Host, HostfileError, parse_hostfile

ROOT = Path(__file__).resolve().parents[2]


def test_the_example_parses():
    hosts = parse_hostfile(str(ROOT / "hostfile.example"))
    assert hosts == [Host("node1", 2), Host("node2", 2), Host("node3", 1), Host("gpu-old", 1)]


@pytest.mark.parametrize("text,message", [
    ("node1 slots=two\n", "slots must be a whole number"),
    ("node1 slots=0\n", "slots must be a whole number"),
    ("node1 cores=2\n", "is not slots=N"),
    ("node1\nnode1\n", "listed twice"),
    ("node1 slots=4 max_slots=2\n", "below slots"),
    ("no$de slots=1\n", "not a host name"),
    ("# only comments\n\n", "no hosts"),
])
def test_bad_hostfiles_are_named_with_their_line(tmp_path, text, message):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(HostfileError, match=message):
        parse_hostfile(str(path))


def test_cli_prints_one_line_and_exits_2(tmp_path):
    bad = tmp_path / "hosts"
    bad.write_text("a slots=1\nb slots=-1\n")
    proc = subprocess.run([sys.executable, "-m", "ashl.hostfile", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"ashl.hostfile: error: {bad}:2: slots must be a whole number >= 1, got '-1'"]
    missing = subprocess.run([sys.executable, "-m", "ashl.hostfile", str(tmp_path / "nope")],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def test_bench_e2e_checks_its_hostfile_before_launching(tmp_path):
    bad = tmp_path / "hosts"
    bad.write_text("node1 slots=x\n")
    proc = subprocess.run([sys.executable, "-m", "ashl.bench", "e2e", "--hostfile", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"ashl.bench e2e: error: --hostfile '{bad}': {bad}:1: slots must be a whole number "
        ">= 1, got 'x'"]
    small = tmp_path / "small"
    small.write_text("node1 slots=2\n")
    proc = subprocess.run([sys.executable, "-m", "ashl.bench", "e2e", "--hostfile", str(small),
                           "--ranks", "4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "2 slots for --ranks 4" in proc.stderr
