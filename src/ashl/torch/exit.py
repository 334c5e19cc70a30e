"""Leaving the run when the user's script ends, with or without ``opt.finish()``.

A Horovod script ends when its epoch loop ends; it never calls ``finish()``. Every wrapped
optimizer is therefore left at interpreter exit by an ``atexit`` hook registered when the
first one is built, after ``hvd.init()`` and mpi4py's import, so it runs before Horovod shuts
down and MPI is finalised (atexit runs last-registered first), while the server thread and
MPI are still alive. (``import ashl.torch`` initialises MPI through mpi4py, so that mpi4py
finalises it last, on the main thread: see ashl/torch/__init__.py.)

- The script ended normally: ``finish()`` on every optimizer still in the run, so every
  rank ends with the same final global model (collective: every rank gets here).
- The script ended with an uncaught exception on this rank, or called ``sys.exit`` with a
  failure status: the other ranks cannot finish with it (they would wait for its commits or
  its allreduce forever), so the job ends at once with MPI_Abort, after a line that names
  this rank and the error. mpirun reports the rank too. Nothing already trained on disk is
  touched; the job's status is the rank's own. (``sys.exit`` is wrapped to see its status:
  a SystemExit reaches no excepthook. A bare ``raise SystemExit(1)``, ``exit()`` and
  ``os._exit`` are not seen; a ``sys.exit(1)`` the script catches still counts.)
- A fault-tolerant run (``fault_tolerant=True``) never aborts the job and never calls
  MPI_Finalize, which can hang once a peer has died: a failing rank leaves with its own
  status (the others go on without it, as without any lost rank), and at the normal end the
  process exits with ``LOST_RANKS_STATUS`` (3) if the run lost a rank, else 0, after
  flushing its output. (mpirun --enable-recovery reports 0 whatever its ranks' statuses
  are: ``python -m ashl.run`` gives a job the status its ranks meant.)
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import traceback

from ..run import LOST_RANKS_STATUS, write_status
from ..strategies.runtime import is_mpi

__all__ = ["leave_at_exit", "LOST_RANKS_STATUS", "exit_without_finalize", "end_failed_start",
           "start_watchdog"]

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
    real = [o for o in _optimizers if is_mpi(o._ashl.comm)]
    _optimizers.clear()
    live = [o for o in real if not getattr(o, "_ashl_closed", False)]
    if live:
        _leave(live)
    tolerant = [o._ashl for o in real if o._ashl.fault_tolerant]
    if tolerant:
        lost = sorted({x["rank"] for s in tolerant for x in s.lost_ranks})
        dropped = any(getattr(s, "dropped", False) for s in tolerant)
        exit_without_finalize(_failure_status() or (LOST_RANKS_STATUS if lost or dropped else 0),
                              tolerant[0], lost)


def _failure_status() -> int:
    """The status of what is ending the interpreter, if it is a failure (0 if none): an
    uncaught exception is 1, sys.exit(n) is n."""
    if not _failure:
        return 0
    why = _failure[0]
    if isinstance(why, SystemExit):
        return why.code if isinstance(why.code, int) and why.code > 0 else 1
    return 1


def _leave(live: list) -> None:
    from mpi4py import MPI
    if MPI.Is_finalized() or _horovod_shut_down(live):
        print(f"ashl: rank {live[0]._ashl.rank}: MPI or Horovod was shut down before the run "
              "was left (hvd.shutdown() before the end of the script?); call opt.finish() "
              "before it", file=sys.stderr, flush=True)
        return
    if _failure:
        why = _failure[0]
        if isinstance(why, SystemExit):
            _abort(live[0], f"sys.exit({why.code!r})", _failure_status())
        _abort(live[0], f"an uncaught {type(why).__name__}: {why}")
    stalled = threading.Timer(STALL_WARNING_S, _warn_stalled, (live[0]._ashl,))
    stalled.daemon = True
    stalled.start()
    for optimizer in reversed(live):
        try:
            optimizer.finish()
        except BaseException as exc:   # noqa: BLE001 - the job must not hang on it
            traceback.print_exc()
            _abort(optimizer, f"finish() failed at exit: {type(exc).__name__}: {exc}")
    stalled.cancel()


STALL_WARNING_S = 60.0    # as Horovod's stall check: then say what may be wrong


def _warn_stalled(strategy) -> None:
    print(f"ashl: rank {strategy.rank} of {strategy.size}: its script ended {STALL_WARNING_S:g} s "
          "ago and it still waits for the other ranks to reach the end of theirs (as it should "
          "while they train on). If they wait instead in a collective this rank skipped (it "
          "left its training loop early) and that hvd.join() does not complete, the job "
          "cannot end: every rank must leave its loop at the same point (Horovod's stall "
          "warning names the collective)",
          file=sys.stderr, flush=True)


def _horovod_shut_down(live: list) -> bool:
    """Does a strategy that exchanges through Horovod (bsp, the averaging ones) find it shut
    down? (MPI, which mpi4py initialised, outlives hvd.shutdown().)"""
    for optimizer in live:
        hvd = getattr(optimizer._ashl, "hvd", None)
        if hvd is not None and not hvd.is_initialized():
            return True
    return False


def _abort(optimizer, why: str, code: int = 1) -> None:
    strategy = optimizer._ashl
    if strategy.fault_tolerant:
        print(f"ashl: rank {strategy.rank} of {strategy.size} ended with {why}; it leaves the "
              "run (fault-tolerant: the others go on without it)", file=sys.stderr, flush=True)
        exit_without_finalize(code, strategy)
    print(f"ashl: rank {strategy.rank} of {strategy.size} ended with {why}; ending the job "
          "(the other ranks cannot finish without it)", file=sys.stderr, flush=True)
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(code)


def end_failed_start(exc: BaseException, comm=None, abort: bool = True,
                     fault_tolerant: bool = True) -> None:
    """An optimizer failed to start on this rank. A fault-tolerant run's failure is left for
    ``python -m ashl.run`` (mpirun --enable-recovery reports 0). Unless the failure is one
    every rank meets alike (`abort` False: the error is raised on each), the job ends
    (MPI_Abort) after the error is printed, as the others would wait in the start-up
    collectives for ever. A test's in-process world is left as it is (the error is raised)."""
    if comm is not None and not is_mpi(comm):
        return
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()
    if fault_tolerant:
        write_status(rank, MPI.COMM_WORLD.Get_size(), 1, [])
    if not abort:
        return
    traceback.print_exception(exc)
    run = "the fault-tolerant run" if fault_tolerant else "the run"
    print(f"ashl: rank {rank}: {run} could not start ({type(exc).__name__}: {exc}); ending "
          "the job (the other ranks would wait for it in the start-up)", file=sys.stderr,
          flush=True)
    MPI.COMM_WORLD.Abort(1)


def start_watchdog(rank: int, size: int, timeout_s: float) -> threading.Timer:
    """Until it is cancelled, the start-up's collectives, which one lost rank would leave
    waiting for ever: after `timeout_s` the job ends (MPI_Abort), this rank's failure left
    for ashl.run first. Returns the running timer (cancel() it when the start-up is done)."""
    def expire():
        write_status(rank, size, 1, [])
        print(f"ashl: rank {rank}: the start-up (up to profiling and the plan) did not finish "
              f"in {timeout_s:g} s: a rank was lost before training began; ending the job",
              file=sys.stderr, flush=True)
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(1)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    return timer


def exit_without_finalize(status: int, strategy=None, lost=()) -> None:
    """End the process now with `status`, its output flushed, without MPI_Finalize (which
    can hang once a peer has died) or the exit handlers registered before ashl's; the status
    is also left for ``python -m ashl.run`` (ashl.run.write_status)."""
    if strategy is not None:
        write_status(strategy.rank, strategy.size, status, list(lost))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)
