"""What the command lines share: ``python -m ashl.train`` and ``python -m ashl.bench e2e``.

The options that describe one training job (model, data, emulated cluster, budget,
hyper-parameters; checkpoints, so far ``ashl.train``'s alone), their parsing and their
checks. A check raises :class:`OptionError` with the one line to show (naming the option and
its value); each CLI turns it into ``PROG: error: ...`` and exit status 2,
:class:`OneLineParser` for argparse's own errors.

Pure functions: no torch, no MPI.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
from typing import Iterator, Optional, Sequence

from .emulation import DEFAULT_LINK, Link
from .outer_spec import OuterSpecError, parse_outer
from .strategies import (CHECKPOINTING, FAULT_TOLERANT, OVERLAPPING, PARAMETER_SERVER,
                         STRATEGIES, TRANSPORTS, transport_problem)

DATASET_HELP = "digits (default), mnist, synthetic[:N], cifar10:DIR"
FACTORS_EXAMPLE = "1,1,2,4"
CHECKPOINT_FILE = "ckpt.pt"          # the run's file; each rank's part is ckpt.pt.rank<r>
CHECKPOINT_EVERY = 30.0              # seconds, when --checkpoint-every is not given


class OptionError(ValueError):
    """A bad option value; the message is the whole error line, without the program name."""


def error_line(prog: str, message: str) -> str:
    """``PROG: error: MESSAGE``, on one line whatever the message holds."""
    return f"{prog}: error: {message.splitlines()[0] if message else message}"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line (``PROG: error: ... (see --help)``), exit status 2.
    Subcommand parsers made from it are OneLineParsers too."""

    def error(self, message: str):  # noqa: D401 (argparse API)
        self.exit(2, error_line(self.prog, message) + " (see --help)\n")

    @contextlib.contextmanager
    def checking(self) -> Iterator[None]:
        """Inside, an OptionError ends the program as an argparse error does."""
        try:
            yield
        except OptionError as e:
            self.error(str(e))


# ------------------------------------------------------------------------------ options
def add_run_options(parser: argparse.ArgumentParser, *, max_seconds: float,
                    target_accuracy: Optional[float],
                    factors_default: str = "off by default", link_base_note: str = "",
                    model: str = "mlp", dataset: str = "digits",
                    step_time: Optional[float] = None) -> None:
    """The options of one training job. Each CLI sets its own defaults (`max_seconds`,
    `target_accuracy`, `model`, `dataset`, `step_time`), the help text of the slowdown
    lists' default, and a note on --link-base."""
    p = parser
    p.add_argument("--model", default=model,
                   help="mlp, cnn (small images such as digits); mnistnet (28x28 images, 1.0M "
                        "parameters); resnet18, vgg16 (32x32 images)")
    p.add_argument("--dataset", default=dataset, help=DATASET_HELP)
    p.add_argument("--compute-slowdown", default=None, metavar="F0,F1,...",
                   help=f"per-rank compute slowdown factors >= 1 (missing ranks: 1); "
                        f"{factors_default}")
    p.add_argument("--link-slowdown", default=None, metavar="F0,F1,...",
                   help=f"per-rank link slowdown factors >= 1 of the --link-base link; "
                        f"{factors_default}")
    p.add_argument("--link-base", default=None, metavar="LATENCY_S,BYTES_PER_S",
                   help=f"the factor-1 emulated link (default {DEFAULT_LINK.latency_s:g} s, "
                        f"{DEFAULT_LINK.bytes_per_s:g} B/s){link_base_note}")
    p.add_argument("--step-time", type=float, default=step_time, metavar="S",
                   help="GPU-like steps: a rank's step lasts its compute factor x S seconds of "
                        "wall time, the real work inside it; 0: steps at their real speed "
                        "(default: "
                        f"{'ASHL_EMULATE_STEP_TIME, else 0' if step_time is None else step_time}"
                        "); a step whose real work overruns it is counted")
    p.add_argument("--target-accuracy", type=float, default=target_accuracy,
                   help="stop once rank 0's test accuracy reaches this (0 < a <= 1)")
    p.add_argument("--max-seconds", type=float, default=max_seconds,
                   help="time budget of a run, profiling included")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--eval-every", type=float, default=None, metavar="SECONDS",
                   help="rank 0 evaluates at most this often (default: 0.25 s on digits and "
                        "synthetic data, 1 s on MNIST, 10 s on CIFAR-10)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="parameter-server strategies (" + ", ".join(OVERLAPPING) + "): a rank "
                        "keeps taking local steps while its commit is in flight (default: on "
                        "for ashl, off for the others)")


def check_run_options(args: argparse.Namespace,
                      dataset_must_exist: bool = True) -> tuple[int, ...]:
    """The values of add_run_options' options that need no parsing beyond argparse's, and
    --dataset; returns the dataset's input shape. The slowdown lists and --link-base are
    parsed apart (parse_factors, parse_link): each CLI fills in its own defaults."""
    budget = args.max_seconds
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        raise OptionError(f"--max-seconds {args.max_seconds:g}: the time budget must be a "
                          "finite number of seconds > 0")
    if args.target_accuracy is not None and not (0 < args.target_accuracy <= 1):
        raise OptionError(f"--target-accuracy {args.target_accuracy:g}: must be in (0, 1] "
                          "(a fraction, not a percentage)")
    if args.batch_size < 1:
        raise OptionError(f"--batch-size {args.batch_size}: must be >= 1")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise OptionError(f"--lr {args.lr:g}: the learning rate must be a finite number > 0")
    if args.seed < 0:
        raise OptionError(f"--seed {args.seed}: must be >= 0")
    step = args.step_time
    if step is not None and not (math.isfinite(step) and step >= 0):
        raise OptionError(f"--step-time {args.step_time:g}: must be a finite number of "
                          "seconds >= 0 (0: real speed)")
    every = args.eval_every
    if every is not None and not (math.isfinite(every) and every >= 0):
        raise OptionError(f"--eval-every {args.eval_every:g}: must be a number of seconds >= 0")
    return check_dataset_spec(args.dataset, must_exist=dataset_must_exist)


def add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    """--checkpoint-dir, --checkpoint-every, --resume (checked by check_checkpoint_options)."""
    p = parser
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help=f"save the run, atomically, every --checkpoint-every seconds and at the "
                        f"end: DIR/{CHECKPOINT_FILE} (rank 0: global model, plan, stage, "
                        f"counters) and DIR/{CHECKPOINT_FILE}.rank<r> (rank r's optimizer "
                        "state); a run without --resume starts afresh and replaces them; not "
                        f"with {', '.join(s for s in STRATEGIES if s not in CHECKPOINTING)}")
    p.add_argument("--checkpoint-every", type=float, default=None, metavar="SECONDS",
                   help=f"seconds between two checkpoints (default {CHECKPOINT_EVERY:g}); "
                        "localsgd, diloco and ashl-sync save at the first epoch end after that, "
                        "every rank together")
    p.add_argument("--resume", action="store_true",
                   help="continue the run saved in --checkpoint-dir (same strategy, rank count "
                        "and model); the budgets count from the resume")


def checkpoint_path(directory: str) -> str:
    """The run's checkpoint file in --checkpoint-dir."""
    return os.path.join(directory, CHECKPOINT_FILE)


def check_checkpoint_options(args: argparse.Namespace) -> None:
    """add_checkpoint_options' options against each other, the strategy and the directory;
    fills in --checkpoint-every's default. Raises OptionError."""
    directory, every = args.checkpoint_dir, args.checkpoint_every
    if every is not None and not (math.isfinite(every) and every > 0):
        raise OptionError(f"--checkpoint-every {every:g}: must be a finite number of seconds > 0")
    if directory is None:
        if args.resume or every is not None:
            raise OptionError(f"{'--resume' if args.resume else '--checkpoint-every'}: "
                              "needs --checkpoint-dir DIR")
        return
    if args.strategy not in CHECKPOINTING:
        raise OptionError(f"--strategy {args.strategy!r} does not checkpoint (no --checkpoint-dir "
                          f"or --resume); strategies that do: {', '.join(CHECKPOINTING)}")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise OptionError(f"--checkpoint-dir {directory!r}: exists and is not a directory")
    if args.resume and not os.path.isfile(checkpoint_path(directory)):
        why = "holds no checkpoint" if os.path.isdir(directory) else "does not exist"
        raise OptionError(f"--resume: --checkpoint-dir {directory!r} {why} "
                          f"(no {CHECKPOINT_FILE} to resume from)")
    if every is None:
        args.checkpoint_every = CHECKPOINT_EVERY


# ------------------------------------------------------------------------------ values
def parse_factors(option: str, text: Optional[str]) -> list[float]:
    """'1,2,4' -> [1.0, 2.0, 4.0], None -> []; any malformed item is an error naming the
    option, its value and the item."""
    if text is None:
        return []
    factors = []
    for item in text.split(","):
        item = item.strip()
        try:
            value = float(item)
        except ValueError:
            raise OptionError(f"{option} {text!r}: {item!r} is not a number (expected "
                              f"comma-separated factors >= 1, one per rank, e.g. "
                              f"{FACTORS_EXAMPLE})") from None
        if not math.isfinite(value) or value < 1:
            raise OptionError(f"{option} {text!r}: {item} is not a finite factor >= 1")
        factors.append(value)
    return factors


def check_factor_count(option: str, text: Optional[str], factors: Sequence[float],
                       ranks: int) -> None:
    """A list may be shorter than the run (missing ranks: 1), never longer."""
    if len(factors) > ranks:
        raise OptionError(f"{option} {text!r} lists {len(factors)} factors but the run has "
                          f"{ranks} rank{'s' if ranks != 1 else ''}")


def format_factors(factors: Sequence[float]) -> str:
    """[1.0, 2.5] -> '1,2.5', the shortest text parse_factors reads back exactly."""
    return ",".join(f"{v:g}" if float(f"{v:g}") == v else repr(float(v)) for v in factors)


def parse_link(text: Optional[str]) -> Link:
    """'LATENCY_S,BYTES_PER_S' -> Link; None -> the default link."""
    if text is None:
        return DEFAULT_LINK
    try:
        latency, bandwidth = (float(x) for x in text.split(","))
    except ValueError:
        raise OptionError(f"--link-base {text!r}: expected LATENCY_S,BYTES_PER_S "
                          "(e.g. 5e-4,125e6)") from None
    try:
        return Link(latency, bandwidth)
    except ValueError as e:
        raise OptionError(f"--link-base {text!r}: {e}") from None


def check_strategy(name: str) -> str:
    if name not in STRATEGIES:
        raise OptionError(f"--strategy {name!r}: unknown strategy (known: {', '.join(STRATEGIES)})")
    return name


def check_outer(strategy: str, spec: str, where: str) -> str:
    """An outer optimizer for `strategy` (``--outer-optimizer``, or the SPEC of a
    STRATEGY+SPEC name): its one spelling ('nesterov' -> 'nesterov(0.7, 0.9)'); OptionError
    beginning with `where` if it is misspelt or the strategy (bsp) merges no deltas."""
    if strategy == "bsp":
        raise OptionError(f"{where}: strategy bsp averages gradients every step; an outer "
                          "optimizer needs a strategy that merges model deltas")
    try:
        return str(parse_outer(spec))
    except OuterSpecError as e:
        raise OptionError(f"{where}: {e.why}") from None


def check_overlap(strategy: str) -> None:
    """--overlap: a parameter-server strategy (OptionError)."""
    if strategy not in OVERLAPPING:
        raise OptionError(f"--overlap: strategy {strategy} has no commit in flight to overlap "
                          f"(it exchanges in collectives); use one of {', '.join(OVERLAPPING)}")


def check_fault_tolerant(strategy: str, timeout_s: float) -> None:
    """--fault-tolerant: an asynchronous strategy and a timeout > 0 (OptionError)."""
    if strategy not in FAULT_TOLERANT:
        raise OptionError(f"--fault-tolerant: strategy {strategy} is synchronous and fail-stop "
                          "(every round needs every rank); use one of "
                          f"{', '.join(FAULT_TOLERANT)}")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise OptionError(f"--fault-timeout {timeout_s:g}: must be a number of seconds > 0")


def add_transport_option(p: argparse.ArgumentParser, default_note: str) -> None:
    # not given: absent (SUPPRESS), so the help shows default_note and no "(default: None)"
    p.add_argument("--transport", default=argparse.SUPPRESS,
                   metavar="{" + ",".join(TRANSPORTS) + "}",
                   help="how commits reach the parameter server (" + ", ".join(PARAMETER_SERVER)
                        + "): zmq (event-driven, the server rank's own commits in-process) or "
                        "mpi (point-to-point, sleep-polled; for fabrics where MPI is faster, "
                        f"e.g. RDMA) (default: {default_note})")


def add_device_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto",
                   help="where each rank trains (ashl.device): auto (cuda:<local rank> when "
                        "the host has a GPU, else cpu), cpu, cuda or cuda:N")


def check_device(spec: str) -> str:
    """--device: one of ashl.device's spellings (whether the host has the GPU is known only
    once torch is imported: the run checks that)."""
    from .device import check_device_spec
    try:
        return check_device_spec(spec)
    except ValueError as exc:
        raise OptionError(f"--device {spec!r}: expected {str(exc).split('expected ')[1]}") from None


def check_transport(transport: Optional[str], strategy: Optional[str] = None,
                    fault_tolerant: bool = False) -> None:
    """--transport: a known one, for a parameter-server strategy (when `strategy` is
    given), zmq when fault-tolerant (OptionError)."""
    if transport is None:   # not given
        return
    problem = transport_problem(transport, fault_tolerant)
    if problem is None and strategy is not None and strategy not in PARAMETER_SERVER:
        problem = (f"strategy {strategy} has no parameter server (its rounds are "
                   f"allreduces); --transport is for {', '.join(PARAMETER_SERVER)}")
    if problem is not None:
        raise OptionError(f"--transport {transport!r}: {problem}")


def split_variant(name: str) -> tuple[str, Optional[str]]:
    """'ashl+nesterov(0.7, 0.5)' -> ('ashl', 'nesterov(0.7, 0.5)'): a strategy run with an
    outer optimizer; a plain name -> (name, None)."""
    base, plus, outer = name.partition("+")
    return base.strip(), (outer.strip() if plus else None)


def parse_strategies(text: Optional[str], default: Sequence[str]) -> list[str]:
    """--strategies 'a,b' -> ['a', 'b'] (None: `default`); every name known, none twice. A
    name may carry an outer optimizer, STRATEGY+SPEC (commas inside SPEC's parentheses do
    not split the list), returned in one spelling: 'ashl+nesterov' -> 'ashl+nesterov(0.7, 0.9)'."""
    if text is None:
        return list(default)
    names = [s.strip() for s in re.split(r",(?![^(]*\))", text) if s.strip()]
    if not names:
        raise OptionError(f"--strategies {text!r}: no strategy named")
    unknown = [s for s in names if split_variant(s)[0] not in STRATEGIES]
    if unknown:
        raise OptionError(f"--strategies {text!r}: unknown {', '.join(map(repr, unknown))} "
                          f"(known: {', '.join(STRATEGIES)})")
    names = [_one_spelling(text, name) for name in names]
    if len(set(names)) != len(names):
        raise OptionError(f"--strategies {text!r}: a strategy is named twice")
    return names


def _one_spelling(text: str, name: str) -> str:
    """A STRATEGY+SPEC name with SPEC parsed and written back ('ashl+nesterov' ->
    'ashl+nesterov(0.7, 0.9)'), so one variant has one name and one run folder."""
    base, outer = split_variant(name)
    if outer is None:
        return name
    return f"{base}+{check_outer(base, outer, f'--strategies {text!r}: {name!r}')}"


def check_dataset_spec(spec: str, must_exist: bool = True) -> tuple[int, ...]:
    """Syntax (and, if `must_exist`, the directory) of --dataset; no data read. Returns the
    input shape."""
    name, sep, arg = spec.partition(":")
    name = name.strip().lower()
    if name == "digits":
        if sep:
            raise OptionError(f"--dataset {spec!r}: digits takes no argument")
        return (1, 8, 8)
    if name == "mnist":
        if sep:
            raise OptionError(f"--dataset {spec!r}: mnist takes no argument")
        return (1, 28, 28)
    if name == "synthetic":
        if sep:
            try:
                n = int(arg)
            except ValueError:
                raise OptionError(f"--dataset {spec!r}: synthetic:N needs an integer sample "
                                  "count N") from None
            if n < 20:
                raise OptionError(f"--dataset {spec!r}: synthetic needs N >= 20 samples "
                                  "(2 per class)")
        return (1, 8, 8)
    if name == "cifar10":
        if not arg:
            raise OptionError(f"--dataset {spec!r}: cifar10 needs a directory, cifar10:DIR")
        if must_exist and not os.path.isdir(arg):
            raise OptionError(f"--dataset {spec!r}: directory {arg!r} does not exist")
        return (3, 32, 32)
    raise OptionError(f"--dataset {spec!r}: unknown dataset (known: {DATASET_HELP})")
