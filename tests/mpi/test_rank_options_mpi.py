"""Ranks that pass DistributedOptimizer different run-wide options, or one rank whose options
are refused, end the job at its start with an error on every rank that names the ranks and
the options; before, the others waited for ever in the start-up's collectives (an options
difference that left no collective waiting trained on, each rank with its own bound). A
rank whose start fails after the agreement ends the job."""
from pathlib import Path

import pytest

from _util import mpirun, skip_reason  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(skip_reason() is not None,
                                                  reason=str(skip_reason()))]
SCRIPT = Path(__file__).with_name("rank_options.py")


# (which options differ, and how they read, is tests/unit/test_agreement.py's; here the
# collective, plain, under a fault-tolerant run's watchdog, and before Horovod's (bsp))
@pytest.mark.parametrize("args, every_rank_says", [
    (["--rank1-strategy", "localsgd"], "strategy is 'ashl' on rank 0, 'localsgd' on rank 1"),
    (["--rank0-fault-tolerant"], "fault_tolerant is True on rank 0, False on rank 1"),
    (["--strategy", "bsp", "--rank1-backward-passes-per-step", "2"],
     "backward_passes_per_step is 1 on rank 0, 2 on rank 1"),
])
def test_options_that_differ_between_ranks_are_refused_on_every_rank(args, every_rank_says):
    proc = mpirun(2, SCRIPT, *args, timeout=90, check=False)
    assert proc.returncode != 0, proc.stdout
    # every rank raises it; the first to end the job may cut the other's line short
    assert every_rank_says in proc.stderr, proc.stderr[-4000:]
    assert "epoch 0" not in proc.stdout


def test_a_refusal_on_one_rank_reaches_the_other():
    """localsgd has no commit in flight to overlap: rank 1 refuses overlap=True with its own
    error, and rank 0, which would have gone on into localsgd's start, raises it too."""
    proc = mpirun(2, SCRIPT, "--strategy", "localsgd", "--rank1-overlap", "on", timeout=90,
                  check=False)
    assert proc.returncode != 0, proc.stdout
    assert "options were refused on rank 1: ValueError: overlap=True: strategy 'localsgd'" \
        in proc.stderr, proc.stderr[-4000:]
    assert "ValueError: overlap=True: strategy 'localsgd' exchanges in collectives" \
        in proc.stderr


def test_a_ranks_own_option_refused_after_the_agreement_ends_the_job():
    """global_model_on= is each rank's own (not compared); refused on rank 1 alone, in the
    strategy's start, it ends the job where rank 0 waited for rank 1 in a collective."""
    proc = mpirun(2, SCRIPT, "--rank1-global-model-on", "gpu", timeout=90, check=False)
    assert proc.returncode != 0, proc.stdout
    assert "ashl: rank 1: the run could not start (ValueError: global_model_on must be" \
        in proc.stderr, proc.stderr[-4000:]
