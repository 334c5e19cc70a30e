"""A user's Horovod script, converted by exactly three changed lines (ashl.convert), under
mpirun and horovodrun: no finish() call, no budget, Horovod's keywords, hvd.allreduce'd
metrics. It exits 0 and reaches the unchanged Horovod script's accuracy within the 20 epochs
(within 3 points in one run on a 2-core machine; the benchmark's median is within 2).
A rank that raises mid-epoch, or calls sys.exit with a failure status, ends the job at once,
naming the rank (no hang, no segfault)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest


import _util  # noqa: E402
from ashl.bench.script import _TEST_LINE
from ashl.convert import convert

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "horovod_digits.py"
EPOCHS = "20"


def converted(tmp_path, text=None, strategy=None) -> Path:
    text = convert(SCRIPT.read_text() if text is None else text)
    if strategy is not None:
        text = "\n".join(
            line.replace("sampler=train_sampler)", f"sampler=train_sampler, strategy={strategy!r})")
            if "ashl.DistributedOptimizer(" in line else line for line in text.splitlines())
        assert text.count(f"strategy={strategy!r}") == 1
    out = tmp_path / "ashl_digits.py"
    out.write_text(text)
    return out


def accuracy(result: Path) -> float:
    return float(result.read_text().split()[1])


# GPU-like steps for both scripts (as make bench-script): a step lasts 10 ms with its real
# compute inside, so 3 ranks and the server thread do not fight over 2 cores. Without it the
# contention skewed ashl's plan on equal ranks (seen: shares 9/17, 4/17, 4/17, k = 8) and
# one run in several ended 3 points short.
GPU_LIKE = {"ASHL_EMULATE_STEP_TIME": "0.01"}


def test_ashl_reaches_horovods_accuracy_and_exits_cleanly(tmp_path):
    plain = _util.mpirun(3, "-m", "ashl.emulate", SCRIPT, "--epochs", EPOCHS,
                         "--result", tmp_path / "hvd.txt", timeout=300, env=GPU_LIKE)
    proc = _util.mpirun(3, converted(tmp_path), "--epochs", EPOCHS,
                        "--result", tmp_path / "ashl.txt", timeout=300, env=GPU_LIKE)
    assert "Segmentation fault" not in proc.stdout + proc.stderr
    horovod = epoch_accuracies(plain.stdout)
    epochs = epoch_accuracies(proc.stdout)
    assert len(epochs) == len(horovod) == int(EPOCHS)   # the script's own test() every epoch
    # One run of each: held to 3 points (the old merge was 6 short; the benchmark's median
    # over repeats holds 2, BENCHMARKS.md), on the mean of the last three epochs, as one
    # epoch's reading of 360 test images moves by a point or more (one CI run read 3.06
    # points short on the last epoch alone).
    assert max(epochs) >= max(horovod) - 0.03, (epochs, horovod)
    assert abs(last_three(epochs) - last_three(horovod)) <= 0.03, (epochs, horovod)
    final = accuracy(tmp_path / "ashl.txt")
    assert abs(final - last_three(horovod)) <= 0.03, (final, epochs, horovod)


def epoch_accuracies(stdout: str) -> list[float]:
    return [float(m.group(2)) / 100 for m in _TEST_LINE.finditer(stdout)]


def last_three(accuracies: list[float]) -> float:
    return sum(accuracies[-3:]) / 3


def test_the_converted_script_under_horovodrun(tmp_path):
    proc = _util.horovodrun("-np", 3, "-H", "localhost:3", sys.executable, converted(tmp_path),
                            "--epochs", EPOCHS, "--result", tmp_path / "r.txt", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert accuracy(tmp_path / "r.txt") > 0.85


def failing_run(tmp_path, rank, failure, imports=""):
    """The converted script with `failure` on `rank` mid-epoch 2: it must end the job, not
    hang or crash; returns the job's output."""
    text = SCRIPT.read_text().replace(
        "        optimizer.step()\n",
        "        optimizer.step()\n"
        f"        if hvd.rank() == {rank} and epoch == 2 and batch_idx == 3:\n"
        f"            {failure}\n").replace("import argparse\n", f"import argparse\n{imports}")
    cmd = ["mpirun", "-np", "3", "--oversubscribe", "--bind-to", "none", sys.executable,
           str(converted(tmp_path, text)), "--epochs", "4"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_util.mpi_env(), timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 139) and "Segmentation fault" not in out, out[-3000:]
    return out


def test_a_rank_that_raises_mid_epoch_ends_the_job_naming_it(tmp_path):
    out = failing_run(tmp_path, 1, "raise RuntimeError('a bad batch')")
    assert "RuntimeError: a bad batch" in out
    assert "ashl: rank 1 of 3 ended with an uncaught RuntimeError: a bad batch" in out


def test_a_rank_that_exits_with_a_failure_status_ends_the_job_naming_it(tmp_path):
    out = failing_run(tmp_path, 2, "sys.exit(3)", imports="import sys\n")
    assert "ashl: rank 2 of 3 ended with sys.exit(3)" in out, out[-3000:]


@pytest.mark.parametrize("strategy,owner,join", [
    ("ashl", "mpi4py", False), ("ashl", "horovod-first", False), ("localsgd", "mpi4py", False),
    ("ashl-sync", "horovod-first", False), ("diloco", "mpi4py", False),
    ("bsp", "mpi4py", False), ("adsp", "mpi4py", False),
    ("localsgd", "mpi4py", True), ("bsp", "mpi4py", True), ("ashl", "mpi4py", True)])
def test_a_rank_that_leaves_its_loop_early_ends_the_job_instead_of_hanging_it(
        strategy, owner, join, tmp_path):
    """Rank 1 leaves its epoch loop while the others go on to their metrics' allreduce. It
    leaves the run in hvd.join(), as Horovod's recipe for uneven data has it: the others'
    allreduces complete with zeros in its place, they stop training at their next round or
    commit, and the job ends with every epoch's test line. It used to wait for ever (its
    exit's last round, or the final broadcast, met the others' allreduce). Both layouts:
    hvd.init() after ``import ashl.torch`` (mpi4py owns MPI) and before it."""
    text = SCRIPT.read_text().replace(
        "        train(epoch)\n",
        "        train(epoch)\n        if hvd.rank() == 1 and epoch == 2:\n            break\n")
    assert "epoch == 2" in text
    if join:    # and Horovod's recipe for uneven data: every rank's epoch ends in hvd.join()
        text = text.replace('f"\\tLoss: {loss.item():.6f}")\n',
                            'f"\\tLoss: {loss.item():.6f}")\n    hvd.join()\n')
        assert "hvd.join()" in text
    script = converted(tmp_path, text, strategy)
    if owner == "horovod-first":
        script.write_text(horovod_first(script.read_text()))
    proc = _util.mpirun(3, script, "--epochs", "4", timeout=120, env=GPU_LIKE, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Segmentation fault" not in out, out[-3000:]
    assert len(_TEST_LINE.findall(proc.stdout)) == 4, out[-3000:]   # rank 0's, every epoch


@pytest.mark.parametrize("strategy", ["ashl-sync", "localsgd", "bsp", "ashl", "async-localsgd"])
def test_the_epoch_loop_on_an_uneven_cluster(strategy, tmp_path):
    # Per-rank H_i and shares give the ranks different numbers of rounds per epoch; the
    # script's hvd.allreduce of its metrics between epochs used to meet a round's allreduce
    # on another rank (ashl-sync: a deadlock). The epoch join lines them up. ashl and
    # async-localsgd: the fast ranks step on while the x4 rank profiles (40 steps' time,
    # epochs of 15), but not past their pass, or their metrics' allreduce would meet the
    # others' plan (a deadlock). GPU-like 10 ms
    # steps: with 5 ms, the real CNN step overran the budget on a busy 2-core machine, the
    # profiled plan skewed, and one CI run of ashl-sync ended at 0.39 after 6 epochs.
    proc = _util.mpirun(3, converted(tmp_path, strategy=strategy), "--epochs", "6", "--result", tmp_path / "r.txt", timeout=150,
                        env={"ASHL_EMULATE_COMPUTE": "1,2,4", "ASHL_EMULATE_STEP_TIME": "0.01",
                             # a crash at exit, 1 CI run in 3: every thread's Python stack
                             "PYTHONFAULTHANDLER": "1"})
    assert len(_TEST_LINE.findall(proc.stdout)) == 6
    assert accuracy(tmp_path / "r.txt") > 0.5


# A training set the ranks and the batch do not divide: 97 samples over 3 ranks in batches
# of 32 would be 33/32/32 samples, 2/1/1 batches (bsp's lockstep breaks; the others' first
# round spanned epochs of different lengths and met the script's metrics allreduce); 2
# samples leave a rank with none (it never stepped; the others waited for it). Horovod's
# DistributedSampler pads both; so does ashl's sampler, and the first round ends within the
# first epoch. With Horovod's recipe for uneven data, hvd.join() after each epoch's loop
# (a joined rank adds zeros to the others' allreduces: ashl's rounds read them as ranks
# that left, and stopped), the ranks meet at the join with nothing left to reduce.
@pytest.mark.parametrize("strategy,samples,join", [
    ("ashl", 97, False), ("localsgd", 97, True), ("bsp", 97, False), ("bsp", 97, True),
    ("ashl", 2, False)])
def test_a_dataset_the_ranks_do_not_divide(strategy, samples, join, tmp_path):
    text = SCRIPT.read_text().replace(
        "train_dataset, test_dataset = data.train, data.test",
        f"train_dataset = torch.utils.data.Subset(data.train, range({samples}))\n"
        "    test_dataset = data.test")
    if join:
        text = text.replace('f"\\tLoss: {loss.item():.6f}")\n',
                            'f"\\tLoss: {loss.item():.6f}")\n    hvd.join()\n')
        assert "hvd.join()" in text
    assert "Subset" in text
    proc = _util.mpirun(3, converted(tmp_path, text, strategy=strategy), "--epochs", "4",
                        timeout=150, env={"ASHL_EMULATE_COMPUTE": "1,2,4", **GPU_LIKE})
    assert len(_TEST_LINE.findall(proc.stdout)) == 4


# The converted import line starts MPI through mpi4py (ashl.torch), so one rank's Horovod
# shutdown does not finalise MPI on the others (Horovod would, on its background thread,
# under whatever their main threads still do).
OUTLIVES_HOROVOD = """import time
import horovod.torch as hvd, ashl.torch as ashl
hvd.init()
from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
MPI.COMM_WORLD.Barrier()
if rank == 0:
    hvd.shutdown()
else:
    time.sleep(1.0)
print(f"rank {rank} finalized={MPI.Is_finalized()}", flush=True)
"""


@pytest.mark.parametrize("strategy", ["localsgd", "bsp"])
def test_hvd_shutdown_before_the_run_is_left_says_to_finish_first(strategy, tmp_path):
    """Under the strategies that exchange through Horovod, MPI (mpi4py's) outlives
    hvd.shutdown(): the exit must still name the mistake, not fail on an uninitialised
    Horovod. (The parameter-server strategies finish over MPI alone, so for them it is no
    mistake.)"""
    text = SCRIPT.read_text() + "    hvd.shutdown()\n"
    proc = _util.mpirun(3, converted(tmp_path, text, strategy=strategy), "--epochs", "1",
                        timeout=120, env=GPU_LIKE, check=False)
    said = "shut down before the run was left (hvd.shutdown() before the end of the script?)"
    assert said in proc.stderr and "call opt.finish() before it" in proc.stderr, proc.stderr
    assert "has not been initialized" not in proc.stderr, proc.stderr


def test_one_ranks_horovod_shutdown_leaves_mpi_to_every_rank(tmp_path):
    script = tmp_path / "outlives.py"
    script.write_text(OUTLIVES_HOROVOD)
    proc = _util.mpirun(2, script, timeout=60)
    assert sorted(proc.stdout.split("\n")[:-1]) == ["rank 0 finalized=False",
                                                   "rank 1 finalized=False"], proc.stdout


# The control rank is slow to leave (its ends' linger; a busy machine): the others must wait
# for it. The converted script imports ashl.torch before hvd.init(), so mpi4py owns MPI
# (above). A script that calls hvd.init() first leaves MPI to Horovod: the first rank to shut
# Horovod down finalises MPI on every rank, and a control rank still freeing a communicator
# then segfaulted (async-localsgd, 1 CI run in 40); the run's last barrier keeps every rank
# off MPI from then on ("horovod-first").
SLOW_TO_LEAVE = """import time
from ashl.coordinator import MPICoordinator
_close = MPICoordinator.close


def _slow_close(self, collective=True):
    _close(self, collective)
    if self.is_root:
        time.sleep(1.0)


MPICoordinator.close = _slow_close
"""


def horovod_first(text: str) -> str:
    """The converted script with ashl.torch imported after hvd.init(): Horovod owns MPI."""
    edits = [("import horovod.torch as hvd, ashl.torch as ashl\n",
              "import sys\nimport horovod.torch as hvd\n"),
             ("    hvd.init()\n",
              "    assert 'mpi4py.MPI' not in sys.modules   # hvd.init() starts MPI\n"
              "    hvd.init()\n"
              "    import ashl.torch as ashl\n")]
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


@pytest.mark.parametrize("strategy,owner", [
    ("async-localsgd", "mpi4py"), ("ashl-sync", "mpi4py"), ("async-localsgd", "horovod-first")])
def test_the_job_exits_cleanly_when_a_rank_is_slow_to_leave(strategy, owner, tmp_path):
    text = SCRIPT.read_text().replace("import argparse\n", f"import argparse\n{SLOW_TO_LEAVE}")
    script = converted(tmp_path, text, strategy)
    if owner == "horovod-first":
        script.write_text(horovod_first(script.read_text()))
    proc = _util.mpirun(3, script, "--epochs", "2",
                        "--result", tmp_path / "r.txt", timeout=150, env=GPU_LIKE)
    assert "Segmentation fault" not in proc.stdout + proc.stderr
    assert len(_TEST_LINE.findall(proc.stdout)) == 2
