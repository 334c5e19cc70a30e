"""Every strategy ends by itself under random slowdowns (a short version of
tests/soak/termination_stress.py, which runs many more jobs)."""
import subprocess
import sys
from pathlib import Path

import pytest

from _util import mpi_env, skip_reason  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(skip_reason() is not None,
                                                  reason=str(skip_reason()))]
SCRIPT = Path(__file__).resolve().parents[1] / "soak" / "termination_stress.py"


def test_short_jobs_of_every_strategy_all_end_cleanly():
    from ashl.strategies import STRATEGIES
    proc = subprocess.run([sys.executable, str(SCRIPT), "--jobs", str(len(STRATEGIES)),
                           "--seed", "7", "--timeout", "90", "--budgets", "2,3"],
                          capture_output=True, text=True, timeout=90 * len(STRATEGIES) + 60,
                          env=mpi_env())
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert f"{len(STRATEGIES)} passed, 0 failed" in proc.stdout
