"""MPI for ashl's PyTorch API: started through mpi4py when ``ashl.torch`` is imported
(ashl/torch/__init__.py says why), and a note of who finalises it."""
import sys


def _horovod_started_mpi() -> bool:
    hvd = sys.modules.get("horovod.torch")
    if hvd is None or "mpi4py.MPI" in sys.modules:
        return False
    try:
        return bool(hvd.is_initialized())
    except Exception:   # noqa: BLE001 - a Horovod that cannot say did not start MPI here
        return False


# hvd.init() before ``import ashl.torch`` started MPI in Horovod, which then finalises it on
# every rank as soon as one rank shuts Horovod down (else mpi4py does, at the interpreter's
# end, after every rank has left the run).
HOROVOD_OWNS_MPI = _horovod_started_mpi()

from mpi4py import MPI  # noqa: E402,F401 - after the note: this import may start MPI
