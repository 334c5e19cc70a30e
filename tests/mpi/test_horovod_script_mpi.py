"""A user's Horovod script, converted by exactly three changed lines (ashl.convert), under
mpirun and horovodrun: no finish() call, no budget, Horovod's keywords, hvd.allreduce'd
metrics. It exits 0, and reaches the unchanged Horovod script's accuracy (within 3 points in
one run here; the benchmark's median is within 2).
A rank that raises mid-epoch ends the job at once, naming the rank (no hang, no segfault)."""
import subprocess
import sys
from pathlib import Path


import _util  # noqa: E402
from ashl.convert import convert

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "horovod_digits.py"
EPOCHS = "20"


def converted(tmp_path, text=None) -> Path:
    out = tmp_path / "ashl_digits.py"
    out.write_text(convert(SCRIPT.read_text() if text is None else text))
    return out


def accuracy(result: Path) -> float:
    return float(result.read_text().split()[1])


def test_ashl_reaches_horovods_accuracy_and_exits_cleanly(tmp_path):
    _util.mpirun(3, SCRIPT, "--epochs", EPOCHS, "--result", tmp_path / "hvd.txt", timeout=300)
    proc = _util.mpirun(3, converted(tmp_path), "--epochs", EPOCHS,
                        "--result", tmp_path / "ashl.txt", timeout=300)
    assert "Segmentation fault" not in proc.stdout + proc.stderr
    # One asynchronous run on a busy 2-core machine: within 3 points here (the old merge was
    # 6 points short); the median over repeats is within 2 (make bench-script, BENCHMARKS.md).
    assert abs(accuracy(tmp_path / "ashl.txt") - accuracy(tmp_path / "hvd.txt")) <= 0.03


def test_the_converted_script_under_horovodrun(tmp_path):
    proc = _util.horovodrun("-np", 3, "-H", "localhost:3", sys.executable, converted(tmp_path),
                            "--epochs", EPOCHS, "--result", tmp_path / "r.txt", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert accuracy(tmp_path / "r.txt") > 0.85


def test_a_rank_that_raises_mid_epoch_ends_the_job_naming_it(tmp_path):
    text = SCRIPT.read_text().replace(
        "        optimizer.step()\n",
        "        optimizer.step()\n"
        "        if hvd.rank() == 1 and epoch == 2 and batch_idx == 3:\n"
        "            raise RuntimeError('a bad batch')\n")
    script = converted(tmp_path, text)
    cmd = ["mpirun", "-np", "3", "--oversubscribe", "--bind-to", "none", sys.executable,
           str(script), "--epochs", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_util.mpi_env(), timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "RuntimeError: a bad batch" in out
    assert "ashl: rank 1 of 3 ended with an uncaught RuntimeError: a bad batch" in out
    assert "Segmentation fault" not in out and proc.returncode != 139
