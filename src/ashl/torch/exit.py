"""Leaving the run when the user's script ends, with or without ``opt.finish()``.

A Horovod script ends when its epoch loop ends; it never calls ``finish()``. Every wrapped
optimizer is therefore left at interpreter exit by an ``atexit`` hook registered when the
first one is built, after ``hvd.init()`` and mpi4py's import, so it runs before Horovod shuts
down and MPI is finalised (atexit runs last-registered first), while the server thread and
MPI are still alive.

- The script ended normally: ``finish()`` on every optimizer still in the run, so every
  rank ends with the same final global model (collective: every rank gets here).
- The script ended with an uncaught exception on this rank, or called ``sys.exit`` with a
  failure status: the other ranks cannot finish with it (they would wait for its commits or
  its allreduce forever), so the job ends at once with MPI_Abort, after a line that names
  this rank and the error. mpirun reports the rank too. Nothing already trained on disk is
  touched; the job's status is the rank's own. (``sys.exit`` is wrapped to see its status:
  a SystemExit reaches no excepthook. A bare ``raise SystemExit(1)``, ``exit()`` and
  ``os._exit`` are not seen; a ``sys.exit(1)`` the script catches still counts.)
"""
from __future__ import annotations

import atexit
import sys
import threading
import traceback

__all__ = ["leave_at_exit"]

_optimizers: list = []
_failure: list = []           # the uncaught exception that is ending the interpreter, if any
_registered = False


def leave_at_exit(optimizer) -> None:
    """Finish `optimizer` at interpreter exit unless the script has finished it."""
    global _registered
    if not _registered:
        _registered = True
        previous, previous_thread = sys.excepthook, threading.excepthook

        def record(kind, value, tb):
            _failure.append(value)
            previous(kind, value, tb)

        def record_thread(args):
            if args.exc_type is not SystemExit:
                _failure.append(args.exc_value)
            previous_thread(args)

        sys.excepthook = record
        threading.excepthook = record_thread
        sys.exit = _recording_exit(sys.exit)
        atexit.register(_at_exit)
    _optimizers.append(optimizer)


def _recording_exit(exit_):
    """sys.exit that notes a failure status (anything but None or 0) before exiting."""
    def exit(status=None):
        if status not in (None, 0) and threading.current_thread() is threading.main_thread():
            _failure.append(SystemExit(status))
        exit_(status)
    exit.__doc__ = exit_.__doc__
    return exit


def _at_exit() -> None:
    # Only runs on a real MPI world are left here (a test's in-process fake world is not).
    live = [o for o in _optimizers if not getattr(o, "_ashl_closed", False)
            and type(o._ashl.comm).__module__.startswith("mpi4py")]
    _optimizers.clear()
    if not live:
        return
    from mpi4py import MPI
    if MPI.Is_finalized():
        print(f"ashl: rank {live[0]._ashl.rank}: MPI was shut down before the run was left "
              "(hvd.shutdown() before the end of the script?); call opt.finish() before it",
              file=sys.stderr, flush=True)
        return
    if _failure:
        why = _failure[0]
        if isinstance(why, SystemExit):
            code = why.code if isinstance(why.code, int) and why.code > 0 else 1
            _abort(live[0], f"sys.exit({why.code!r})", code)
        _abort(live[0], f"an uncaught {type(why).__name__}: {why}")
    for optimizer in reversed(live):
        try:
            optimizer.finish()
        except BaseException as exc:   # noqa: BLE001 - the job must not hang on it
            traceback.print_exc()
            _abort(optimizer, f"finish() failed at exit: {type(exc).__name__}: {exc}")


def _abort(optimizer, why: str, code: int = 1) -> None:
    strategy = optimizer._ashl
    print(f"ashl: rank {strategy.rank} of {strategy.size} ended with {why}; ending the job "
          "(the other ranks cannot finish without it)", file=sys.stderr, flush=True)
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(code)
