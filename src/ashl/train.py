"""``python -m ashl.train``: the per-rank main job. Launch it on every rank:

    mpirun -np 4 --oversubscribe --bind-to none python -m ashl.train --strategy ashl \\
        --compute-slowdown 1,1,2,4 --link-slowdown 1,1,2,4 --target-accuracy 0.93 --out out/train
    horovodrun -np 4 python -m ashl.train --strategy bsp --model cnn

Every rank trains with ``ashl.torch.DistributedOptimizer`` (any strategy of
``ashl.strategies.STRATEGIES``) on an embedded dataset; rank 0 evaluates the test accuracy
(the ``evaluate=`` callback, so the run can stop on ``--target-accuracy``; by default on a
snapshot, in a thread beside its training: ``--eval-in-background``), shows a progress
line on stderr and writes to ``--out``:

    metrics.jsonl   one line per evaluation: t (seconds since the start, profiling
                    included), stage, loss (rank 0's training loss, smoothed), accuracy,
                    commits (the run's total where the strategy knows it, else rank 0's)
    summary.json    strategy, ranks, time_to_target_s (null if missed), final_accuracy,
                    wall_s, utilization per rank (compute_s / wall_s), busy per rank
                    (training or evaluating: (compute_s + evaluator_s) / wall_s),
                    bytes_sent, commits,
                    the plan, every rank's counters, the stop reason, the checkpoint
                    (null without --checkpoint-dir) and whether the run resumed
    timeline.json   the Chrome trace of the run (ASHL_TIMELINE, unless set by the user)
    rank<r>.json    with --fault-tolerant: each rank's own counters (no collective may
                    involve a lost rank, so summary.json's per_rank holds rank 0 alone), and
                    one timeline.rank<r>.json per rank
    curves.png      accuracy and loss against wall time

With ``--checkpoint-dir DIR`` the run is saved (the strategy's save_checkpoint, atomically) to
DIR/ckpt.pt and DIR/ckpt.pt.rank<r> every ``--checkpoint-every`` seconds and at the end;
``--resume`` continues it: each rank in the epoch it saved, past the batches it had taken.

``--device`` (default auto) puts each rank's model and batches on ``cuda:<local rank>`` when
its host has a GPU (ranks beyond the host's GPUs share them round-robin), else on the CPU
(ashl.device). A parameter-server strategy saves on each rank's own clock (its
save is not collective); localsgd, diloco and ashl-sync save at an epoch end, on every rank
when rank 0's clock says so, so that every rank's part is of the same round.

Options are checked before MPI starts where possible; a bad one ends the run with one line
``ashl.train: error: ...`` naming it, and exit status 2.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import threading
import time
from typing import Optional, Sequence

from .cli import (OneLineParser, OptionError, add_checkpoint_options, add_device_option,
                  add_run_options, add_transport_option, check_checkpoint_options,
                  check_device, check_factor_count, check_fault_tolerant, check_outer,
                  check_overlap, check_run_options,
                  check_strategy, check_transport, checkpoint_path, parse_factors,
                  parse_link)
from .emulation import Heterogeneity, step_time_from_env
from .strategies import PARAMETER_SERVER, STRATEGIES

PROG = "ashl.train"
# Rank count / rank as the launchers export them (checked again after MPI starts).
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


# ------------------------------------------------------------------------------ options
def build_parser(prog: str = PROG) -> OneLineParser:
    p = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--strategy", default="ashl", help=f"one of {', '.join(STRATEGIES)}")
    add_run_options(p, max_seconds=120.0, target_accuracy=None, factors_default="off by default",
                    link_base_note="; alone it emulates that link on every rank")
    p.add_argument("--max-commits", type=int, default=None, help="commit budget (all ranks)")
    p.add_argument("--switch-loss", type=float, default=0.3,
                   help="ASHL: move from AHL to SHL below this global training loss")
    p.add_argument("--profile-steps", type=int, default=10,
                   help="local steps each rank times before the plan")
    p.add_argument("--outer-optimizer", default=None, metavar="SPEC",
                   help="what the merged update does to the global model: none, "
                        "nesterov(lr, momentum) or delayed-nesterov(lr, momentum, n) "
                        "(default: the strategy's own; not with bsp)")
    p.add_argument("--fault-tolerant", action="store_true",
                   help="survive lost workers (ashl, ssp, asp, adsp, async-localsgd): commits "
                        "over ZeroMQ, a dead or silent worker is dropped and the others go on; "
                        "launch with mpirun --enable-recovery (docs/LAUNCHING.md); exit "
                        "status 3 when a worker was lost")
    p.add_argument("--fault-timeout", type=float, default=5.0, metavar="S",
                   help="with --fault-tolerant: a killed worker is dropped at once (its "
                        "connection closes), a frozen or cut-off one after this long without "
                        "heartbeats, one that lives but sends nothing after 6 times this long "
                        "or 3 of its longest rounds, whichever is longer")
    add_transport_option(p, "zmq")
    add_device_option(p)
    p.add_argument("--global-model-on", choices=("host", "device"), default=None,
                   help="where the server rank keeps the global model (ashl, ssp, asp, adsp, "
                        "async-localsgd): host memory, or its --device (default: host)")
    p.add_argument("--server-threads", type=int, default=None, metavar="N",
                   help="CPU kernel threads of the server's merges (parameter-server "
                        "strategies; default: OpenMP's, OMP_NUM_THREADS or every core)")
    add_checkpoint_options(p)
    p.add_argument("--out", default=os.path.join("out", "train"), help="output directory")
    p.add_argument("--eval-in-background", action=argparse.BooleanOptionalAction, default=True,
                   help="rank 0 evaluates a snapshot of the model in a thread while it trains "
                        "on (ashl.torch.BackgroundEvaluator), instead of between its steps")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p


def _env_int(names: Sequence[str]) -> Optional[int]:
    for name in names:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return None


def check_rank_count(args, size: int) -> None:
    check_factor_count("--compute-slowdown", args.compute_slowdown, args.compute_factors, size)
    check_factor_count("--link-slowdown", args.link_slowdown, args.link_factors, size)


def step_time(args: argparse.Namespace) -> Optional[float]:
    """The emulated step time: --step-time (0: none), else ASHL_EMULATE_STEP_TIME."""
    if args.step_time is None:
        return step_time_from_env()
    return args.step_time or None


def default_eval_every(dataset: str) -> float:
    """Seconds between rank 0's evaluations: a test pass must stay a small part of its time."""
    name = dataset.strip().lower().partition(":")[0]
    return {"cifar10": 10.0, "mnist": 1.0}.get(name, 0.25)


def check_options(args: argparse.Namespace) -> argparse.Namespace:
    """Everything that needs neither MPI nor torch; fills in parsed values. Raises
    OptionError."""
    check_strategy(args.strategy)
    args.device = check_device(args.device)
    args.compute_factors = parse_factors("--compute-slowdown", args.compute_slowdown)
    args.link_factors = parse_factors("--link-slowdown", args.link_slowdown)
    args.link = parse_link(args.link_base)
    if args.link_base is not None and not args.link_factors:
        args.link_factors = [1.0]   # an explicit link alone: every rank gets it (factor 1)
    args.input_shape = check_run_options(args)
    if args.max_commits is not None and args.max_commits < 1:
        raise OptionError(f"--max-commits {args.max_commits}: the commit budget must be >= 1")
    if not math.isfinite(args.switch_loss):
        raise OptionError(f"--switch-loss {args.switch_loss:g}: must be a finite number")
    if args.eval_every is None:
        args.eval_every = default_eval_every(args.dataset)
    if args.profile_steps < 3:
        raise OptionError(f"--profile-steps {args.profile_steps}: must be >= 3 (one is warm-up)")
    if args.outer_optimizer is not None:
        check_outer(args.strategy, args.outer_optimizer,
                    f"--outer-optimizer {args.outer_optimizer!r}")
    if args.fault_tolerant:
        check_fault_tolerant(args.strategy, args.fault_timeout)
    args.transport = getattr(args, "transport", None)   # None: the strategy's default
    check_transport(args.transport, args.strategy, args.fault_tolerant)
    if args.global_model_on is not None and args.strategy not in PARAMETER_SERVER:
        raise OptionError(f"--global-model-on {args.global_model_on}: strategy {args.strategy} has "
                          "no parameter server")
    if args.server_threads is not None:
        if args.strategy not in PARAMETER_SERVER:
            raise OptionError(f"--server-threads {args.server_threads}: strategy "
                              f"{args.strategy} has no parameter server")
        if args.server_threads < 1:
            raise OptionError(f"--server-threads {args.server_threads}: must be >= 1")
    if args.overlap:
        check_overlap(args.strategy)
    if args.max_seconds is None and args.max_commits is None and args.target_accuracy is None:
        raise OptionError("no stop condition: give --max-seconds, --max-commits or "
                          "--target-accuracy")
    check_checkpoint_options(args)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise OptionError(f"--out {args.out!r}: exists and is not a directory")
    if os.environ.get("ASHL_JOIN") and not args.fault_tolerant:
        raise OptionError("ASHL_JOIN is set: a replacement joins a fault-tolerant run; give "
                          "--fault-tolerant (and the run's other options)")
    if os.environ.get("ASHL_JOIN") and args.resume:
        raise OptionError("--resume: a replacement (ASHL_JOIN) takes the run's global model "
                          "from its server, not from a checkpoint")
    size = _env_int(_SIZE_VARS)
    if size is not None and not os.environ.get("ASHL_JOIN"):
        check_rank_count(args, size)
    return args


def check_model(args) -> None:
    """--model against the known models and the dataset's input shape (imports torch)."""
    from .models import MODELS, build_model
    key = args.model.strip().lower().replace("-", "").replace("_", "")
    if key not in MODELS:
        raise OptionError(f"--model {args.model!r}: unknown model (known: {', '.join(MODELS)})")
    if key in ("resnet18", "vgg16") and tuple(args.input_shape[1:]) != (32, 32):
        raise OptionError(f"--model {args.model!r} is built for 32x32 images and --dataset "
                          f"{args.dataset!r} has {'x'.join(map(str, args.input_shape[1:]))}: "
                          "use --model mlp or cnn, or --dataset cifar10:DIR")
    try:
        import torch
        with torch.device("meta"):   # the shape check only: no memory
            build_model(key, args.input_shape, 10)
    except ValueError as e:
        raise OptionError(f"--model {args.model!r}: {e}") from None
    args.model = key


# ------------------------------------------------------------------------------ outputs
def _jsonable(value):
    """Counters may hold numpy / torch scalars or objects: make them JSON."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if hasattr(value, "item"):
        try:
            return _jsonable(value.item())
        except Exception:
            pass
    if hasattr(value, "to_dict"):
        return _jsonable(value.to_dict())
    return str(value)


def read_metrics(path: str) -> list[dict]:
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        pass   # a torn last line of a killed run
    return rows


def time_to_target(rows: Sequence[dict], target: Optional[float]) -> Optional[float]:
    if target is None:
        return None
    for row in rows:
        acc = row.get("accuracy")
        if acc is not None and acc >= target:
            return float(row["t"])
    return None


def plot_curves(rows: Sequence[dict], path: str, title: str,
                target: Optional[float] = None) -> None:
    """Accuracy (left axis) and loss (right axis) against wall seconds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_loss) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    t = [r["t"] for r in rows]
    ax_acc.plot(t, [r.get("accuracy") for r in rows], marker=".", color="tab:blue")
    if target is not None:
        ax_acc.axhline(target, color="grey", linestyle="--", linewidth=1,
                       label=f"target {target:g}")
        ax_acc.legend(loc="lower right")
    ax_acc.set_ylabel("test accuracy")
    ax_acc.set_title(title)
    ax_acc.grid(alpha=0.3)
    loss = [(r["t"], r["loss"]) for r in rows if r.get("loss") is not None]
    if loss:
        ax_loss.plot([a for a, _ in loss], [b for _, b in loss], marker=".", color="tab:red")
    ax_loss.set_ylabel("training loss (rank 0)")
    ax_loss.set_xlabel("wall time [s], profiling included")
    ax_loss.grid(alpha=0.3)
    # Stage changes as vertical lines.
    for prev, row in zip(rows, rows[1:]):
        if row.get("stage") != prev.get("stage"):
            for ax in (ax_acc, ax_loss):
                ax.axvline(row["t"], color="tab:green", alpha=0.4, linewidth=1)
            ax_acc.annotate(str(row.get("stage")), (row["t"], 0.02), xycoords=("data", "axes fraction"),
                            fontsize=8, color="tab:green")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class Progress:
    """Rank 0's progress line on stderr (tqdm), refreshed at most once a second."""

    def __init__(self, enabled: bool, desc: str = "ashl"):
        self.bar = None
        self.next_refresh = 0.0
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(file=sys.stderr, unit="step", mininterval=1.0, miniters=1,
                            dynamic_ncols=True, leave=True, desc=desc)

    def step(self, now: float, describe) -> None:
        if self.bar is None:
            return
        self.bar.update(1)
        if now >= self.next_refresh:
            self.next_refresh = now + 1.0
            self.bar.set_postfix_str(describe(), refresh=False)

    def close(self, text: Optional[str] = None) -> None:
        if self.bar is not None:
            if text:
                self.bar.set_postfix_str(text, refresh=False)
            self.bar.close()


def write_json(path: str, value) -> None:
    """All or nothing: a reader never sees half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_jsonable(value), f, indent=1)
    os.replace(tmp, path)


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


# ------------------------------------------------------------------------------ the run
class Evaluator:
    """Test accuracy of the model as it is now (no gradients, the training mode kept), and
    the seconds spent finding it (`spent_s`: the run's own evaluations are busy time)."""

    batch = 2048

    def __init__(self, model, test, device="cpu"):
        self.model = model
        self.x, self.y = (t.to(device) for t in test.tensors)   # once, not per evaluation
        self.spent_s = 0.0

    def __call__(self) -> float:
        t0 = time.perf_counter()
        try:
            return self.accuracy_of(self.model)
        finally:
            self.spent_s += time.perf_counter() - t0

    def accuracy_of(self, model) -> float:
        import torch
        was_training = model.training
        with torch.no_grad():
            model.eval()
            correct = 0
            for i in range(0, len(self.y), self.batch):
                out = model(self.x[i:i + self.batch])
                correct += (out.argmax(1) == self.y[i:i + self.batch]).sum().item()
            model.train(was_training)
        return correct / max(1, len(self.y))


class SmoothedLoss:
    """Rank 0's training loss, exponentially smoothed; non-finite values are skipped."""

    def __init__(self, weight: float = 0.1):
        self.weight = weight
        self.value: Optional[float] = None

    def add(self, value: float) -> None:
        if math.isfinite(value):
            self.value = value if self.value is None else \
                (1 - self.weight) * self.value + self.weight * value


class MetricsLog:
    """Rank 0's metrics.jsonl: one row per evaluation, ``t`` in seconds since `start`."""

    def __init__(self, path: str, start: float):
        self.path, self.start = path, start
        self.file = open(path, "w")
        self.lock = threading.Lock()              # a background evaluation writes too
        self.last_at: Optional[float] = None      # time.perf_counter() of the last row
        self.accuracy: Optional[float] = None     # the last row's

    def write(self, accuracy: float, stage: str, loss: Optional[float],
              commits: Optional[int], by: str) -> None:
        with self.lock:
            now = time.perf_counter()     # when the accuracy is known
            row = {"t": round(now - self.start, 4), "stage": stage, "loss": loss,
                   "accuracy": accuracy, "commits": commits, "by": by}
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
            self.last_at, self.accuracy = now, accuracy

    def close(self) -> None:
        self.file.close()


def _failure(action) -> Optional[str]:
    """None if `action()` succeeds, else why it failed (one line)."""
    try:
        action()
        return None
    except (OSError, ValueError) as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a checkpoint from elsewhere may fail any way
        return f"{type(e).__name__}: {e}"


class Checkpoints:
    """--checkpoint-dir on one rank: a save every `every` seconds and one at the end, through
    the strategy's save_checkpoint (which writes this rank's part; rank 0 also the run's)."""

    def __init__(self, path: str, every: float, opt, comm):
        from .strategies.parameter_server import ServerStrategy
        self.path, self.every, self.opt, self.comm = path, every, opt, comm
        # A parameter-server run has no point where the ranks agree, and needs none: the
        # server holds the run. Model averaging must save one round on every rank: at an
        # epoch end, where the epoch join has lined the ranks up, when rank 0 says so.
        self.own_clock = isinstance(opt.strategy, ServerStrategy)
        self.last = time.perf_counter()
        self.saves = 0

    def due(self) -> bool:
        return time.perf_counter() - self.last >= self.every

    def after_step(self) -> None:
        if self.own_clock and self.opt.plan is not None and self.due():   # no run before the plan
            self.save()

    def after_epoch(self) -> None:
        """Collective for model averaging: every rank ends the same epochs."""
        if not self.own_clock and self.comm.bcast(self.due(), root=0):
            self.save()

    def save(self) -> None:
        self.opt.save_checkpoint(self.path)
        self.saves += 1
        self.last = time.perf_counter()


class Run:
    """One rank's training run: the model and its DistributedOptimizer; on rank 0 also the
    evaluations, the progress line and the outputs."""

    def __init__(self, args, data, rank: int, size: int, comm, lead: bool = True):
        import torch

        import ashl.torch as ashl
        from .models import build_model
        self.args, self.data, self.rank, self.size, self.comm = args, data, rank, size, comm
        self.lead = lead and rank == 0   # evaluates, writes the outputs (not a replacement)
        self.metrics_path = os.path.join(args.out, "metrics.jsonl")
        torch.manual_seed(args.seed)
        self.device = getattr(args, "torch_device", None) or torch.device("cpu")
        self.model = build_model(args.model, data.input_shape, data.classes).to(self.device)
        self.base_opt = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.sampler = ashl.HeterogeneousSampler(data.train, seed=args.seed)
        self.hetero = Heterogeneity.for_rank(rank, args.compute_factors, args.link_factors,
                                             args.link, step_time(args))
        self.evaluate = Evaluator(self.model, data.test, self.device)
        self.background = None      # rank 0's BackgroundEvaluator (--eval-in-background)
        self.loss = SmoothedLoss()
        self.opt = None
        self.checkpoints: Optional[Checkpoints] = None
        self.first_epoch = 0
        self.skip_batches = 0      # of the first epoch: taken before the checkpoint resumed
        self.metrics: Optional[MetricsLog] = None
        self.progress: Optional[Progress] = None
        self.start = time.perf_counter()
        # A strategy that never calls evaluate still gets curves: rank 0 evaluates its own
        # model when the strategy has been silent for this long (it cannot stop the run).
        self.fallback_after = max(2.0, 3 * args.eval_every)

    def execute(self) -> int:
        self.begin()
        self.train_epochs()
        self.opt.finish()
        if self.background is not None:
            self.background.close()       # an evaluation in flight writes its row first
        if self.checkpoints is not None:
            self.checkpoints.save()       # the final model, on every rank
        wall = time.perf_counter() - self.start
        # within the wall time, not the final one: every evaluation this rank ran between
        # its steps, or (in the background) the snapshots and waits the strategy counted
        eval_s = self.evaluate.spent_s
        if self.background is not None:
            eval_s += self.opt.counters()["eval_s"]
        final_accuracy = self.evaluate() if self.lead else None
        if self.args.fault_tolerant:   # no collective may involve a lost rank: each its own
            everyone = [self.rank_result(wall, eval_s)]
            os.makedirs(self.args.out, exist_ok=True)
            write_json(os.path.join(self.args.out, f"rank{everyone[0]['rank']}.json"), everyone[0])
        else:
            everyone = self.comm.gather(self.rank_result(wall, eval_s), root=0)
        if self.lead:
            self.report(everyone, wall, final_accuracy)
        return self.exit_status()

    def exit_status(self) -> int:
        """0, or LOST_RANKS_STATUS when a fault-tolerant run went on without some rank."""
        from .torch.exit import LOST_RANKS_STATUS
        lost = self.opt.strategy.lost_ranks
        for x in lost if self.lead else ():
            print(f"{PROG}: worker rank {x['rank']} was lost at "
                  f"{x['at_s']:.1f} s ({x['why']}) after {x['commits']} commits, "
                  f"{x['merged']} merged; the run went on without it", file=sys.stderr)
        return LOST_RANKS_STATUS if lost or getattr(self.opt.strategy, "dropped", False) else 0

    # -------------------------------------------------------------- start
    def begin(self) -> None:
        """Start the clock and the optimizer; rank 0 records the initial model."""
        import ashl.torch as ashl
        from .stages import StageConfig
        a = self.args
        stage_config = StageConfig(switch_loss=a.switch_loss, target_accuracy=a.target_accuracy,
                                   max_seconds=a.max_seconds, max_commits=a.max_commits)
        config = dict(stage_config=stage_config, eval_every_s=a.eval_every,
                      profile_steps=a.profile_steps)
        if a.outer_optimizer is not None:
            config["outer_optimizer"] = a.outer_optimizer
        if a.fault_tolerant:
            config.update(fault_tolerant=True, fault_timeout_s=a.fault_timeout)
        if getattr(a, "transport", None) is not None:
            config["transport"] = a.transport
        if a.overlap is not None:          # None: the strategy's default
            config["overlap"] = a.overlap
        if a.global_model_on is not None:
            config["global_model_on"] = a.global_model_on
        if a.server_threads is not None:
            config["server_threads"] = a.server_threads
        if a.strategy in ("ashl", "async-localsgd"):
            # this loop calls no collective between epochs for them (Checkpoints.after_epoch)
            config["profile_within_epoch"] = False
        if self.lead:
            config["evaluate"] = self.on_evaluate
        # Ranks finish importing and loading at different times (a loaded host skews them by
        # seconds): line them up, so the first collective does not charge that to the strategy.
        self.comm.Barrier()
        self.start = time.perf_counter()      # the run's clock: profiling included
        if self.lead:
            self.metrics = MetricsLog(self.metrics_path, self.start)
        self.opt = ashl.DistributedOptimizer(self.base_opt, model=self.model, sampler=self.sampler,
                                             strategy=a.strategy, heterogeneity=self.hetero,
                                             **config)
        ashl.broadcast_parameters(self.model.state_dict(), root_rank=0)
        if a.checkpoint_dir is not None:
            self.checkpoints = Checkpoints(checkpoint_path(a.checkpoint_dir), a.checkpoint_every,
                                           self.opt, self.comm)
            if a.resume:
                self.resume()
        if self.lead:
            # the curves start from the initial model, evaluated before any step (so that no
            # test pass shares the CPU with the profiling steps)
            self.record(self.evaluate(), "start")
            if a.eval_in_background:
                self.background = ashl.BackgroundEvaluator(self.model, self.evaluate.accuracy_of)
            self.progress = Progress(not a.no_progress, a.strategy)
            self.announce_join_address()

    def announce_join_address(self) -> None:
        """A fault-tolerant run says where a replacement joins (also in --out/join_address)."""
        address = getattr(self.opt.strategy, "join_address", None)
        if address:
            others = self.opt.strategy.join_addresses[1:]
            print(f"{PROG}: fault-tolerant run; a replacement joins with ASHL_JOIN={address}"
                  + (f" (or {', '.join(others)})" if others else ""), file=sys.stderr, flush=True)
            with open(os.path.join(self.args.out, "join_address"), "w") as f:
                f.write(address + "\n")

    def resume(self) -> None:
        """--resume, every rank before the first step: all ranks load the checkpoint, or all
        refuse it with the first failing rank's reason (a rank left behind hangs the rest)."""
        path = self.checkpoints.path
        # Read first: a file missing on one rank's host stops every rank before any loads.
        self.refuse(self.comm.allgather(_failure(lambda: self.read_checkpoint(path))))
        errors = self.comm.allgather(_failure(lambda: self.load_checkpoint(path)))
        if any(errors) and not all(errors):
            # Ranks that loaded cannot leave the run with those that did not: the job aborts.
            raise RuntimeError(f"--resume: some ranks could not load {path}: "
                               f"{next(e for e in errors if e)}")
        self.refuse(errors)
        # The optimizer state came back with the saved lr; this loop keeps its lr constant,
        # so the command line's --lr is the one to go on with (and the one summary.json says)
        for group in self.opt.param_groups:
            group["lr"] = self.args.lr

    def load_checkpoint(self, path: str) -> None:
        """Continue in the saved epoch, past the batches this rank had taken in it."""
        position = self.opt.load_checkpoint(path)
        self.first_epoch, self.skip_batches = position["epoch"], position["steps_in_epoch"]

    def read_checkpoint(self, path: str) -> None:
        """The files this rank will load, and the run's fit (strategy, ranks, model size)."""
        from . import checkpoint
        s = self.opt.strategy
        checkpoint.check_run(checkpoint.load(path), path, s.name, s.size, s.numel)
        checkpoint.load(checkpoint.rank_path(path, self.rank))

    def refuse(self, errors: Sequence[Optional[str]]) -> None:
        """If any rank failed (`errors`, one per rank): every rank leaves the run it has not
        started (collective, so the job ends cleanly) and ends with the first reason."""
        failed = [e for e in errors if e]
        if failed:
            self.opt.finish()
            raise OptionError(f"--resume: {failed[0]}")

    def on_evaluate(self):
        """The strategy's callback (rank 0): test accuracy of the global model, in the model
        for this call, or (in the background) a Future of it."""
        return self.evaluate_now("strategy")

    def evaluate_now(self, by: str):
        """Evaluate the model as it is now and write its row: at once, or (in the
        background) when the accuracy is known; returns the accuracy or its Future."""
        if self.background is None:
            accuracy = self.evaluate()
            self.record(accuracy, by)
            return accuracy
        now = self.context()          # the row says what held when the snapshot was taken
        t0 = time.perf_counter()
        pending = self.background()
        if by != "strategy":          # the strategy counts the time its own calls hold it
            self.evaluate.spent_s += time.perf_counter() - t0
        if pending is not None:       # None: the evaluator was closed
            pending.add_done_callback(
                lambda done: done.exception() is None and self.record(done.result(), by, now))
        return pending

    def context(self) -> tuple:
        """(stage, commits, smoothed loss) for a metrics row."""
        if self.opt is None:   # an evaluation before the optimizer is built
            return "PROFILE", None, self.loss.value
        return self.opt.stage, self.commits(), self.loss.value

    def commits(self) -> int:
        """The run's commits where the strategy knows them, else this rank's."""
        strategy = self.opt.strategy
        total = strategy.global_commits
        return int(strategy.commits) if total is None else total

    def record(self, accuracy: float, by: str, context: Optional[tuple] = None) -> None:
        stage, commits, loss = self.context() if context is None else context
        self.metrics.write(accuracy, stage, loss, commits, by)

    # -------------------------------------------------------------- training
    def train_epochs(self) -> None:
        import torch.nn.functional as F
        from torch.utils.data import DataLoader
        opt, epoch = self.opt, self.first_epoch
        while not opt.finished:
            self.sampler.set_epoch(epoch)
            opt.set_epoch(epoch)
            loader = DataLoader(self.data.train, batch_size=self.args.batch_size,
                                sampler=self.sampler)
            skip, self.skip_batches = self.skip_batches, 0
            if skip >= len(loader):    # the checkpoint was saved at this epoch's end
                epoch += 1
                continue
            for x, y in itertools.islice(loader, skip, None):
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                opt.zero_grad()
                loss = F.cross_entropy(self.model(x), y)
                loss.backward()
                opt.step(loss=loss)
                if self.lead:
                    self.watch(float(loss.detach()))
                if opt.finished:
                    break
                if self.checkpoints is not None:
                    self.checkpoints.after_step()
            if self.checkpoints is not None and not opt.finished:
                self.checkpoints.after_epoch()
            epoch += 1

    def watch(self, loss: float) -> None:
        """Rank 0 after each step: the smoothed loss, a fallback evaluation, the progress."""
        self.loss.add(loss)
        now = time.perf_counter()
        if now - (self.metrics.last_at or self.start) > self.fallback_after \
                and not self.opt.finished and not (self.background and self.background.busy):
            self.evaluate_now("loop")
            # between two steps: not the next step's compute (busy counts it once, as an
            # evaluation), nor stretched by an emulated slowdown
            self.opt.strategy.clock.pause(time.perf_counter() - now)
        self.progress.step(now, self.describe)

    def describe(self) -> str:
        wall = max(time.perf_counter() - self.start, 1e-9)
        compute_s = self.opt.counters().get("compute_s", 0.0)
        acc, loss = self.metrics.accuracy, self.loss.value
        return (f"{self.opt.stage} loss {'-' if loss is None else f'{loss:.3f}'} "
                f"acc {'-' if acc is None else f'{acc:.3f}'} "
                f"{self.commits() / wall:.1f} commits/s util {compute_s / wall:.0%}")

    # -------------------------------------------------------------- the end
    def rank_result(self, wall: float, eval_s: float) -> dict:
        """What every rank sends rank 0 for the summary (`evaluator_s`: the time evaluations
        held it within `wall`, the loop's and the start's too; its counters' eval_s has only
        the strategy's; `background_evaluator_s`: the evaluation thread's seconds)."""
        link = self.hetero.link
        return {"rank": self.opt.strategy.rank, "device": str(self.device), "wall_s": wall,
                "evaluator_s": eval_s,
                "background_evaluator_s": (None if self.background is None
                                           else self.background.spent_s),
                "counters": _jsonable(self.opt.counters()),
                "checkpoints_saved": 0 if self.checkpoints is None else self.checkpoints.saves,
                "compute_factor": self.hetero.compute_factor,
                "lr": self.opt.param_groups[0]["lr"],     # what it trained with to the end
                "resumed_at": self.opt.strategy.resumed_at,   # the checkpoint's data position
                "link": None if link is None else [link.latency_s, link.bytes_per_s]}

    def report(self, everyone: list[dict], wall: float, final_accuracy: float) -> None:
        """Rank 0: the last row, summary.json, curves.png and the result lines."""
        self.record(final_accuracy, "final")
        self.metrics.close()
        self.progress.close(f"done: acc {final_accuracy:.3f}")
        rows = read_metrics(self.metrics_path)
        summary = build_summary(self.args, everyone, rows, wall, final_accuracy,
                                self.opt.strategy.stop_reason, self.opt.plan, ranks=self.size)
        out = self.args.out
        write_json(os.path.join(out, "summary.json"), summary)
        title = (f"{self.args.strategy} on {_ranks(self.size)}, "
                 f"{self.args.model}/{self.args.dataset}, "
                 f"compute x{','.join(f'{c:g}' for c in summary['compute_slowdown'])}")
        try:
            plot_curves(rows, os.path.join(out, "curves.png"), title, self.args.target_accuracy)
        except Exception as e:   # a plot is not worth losing the run's results
            print(f"{PROG}: could not draw the plot: {e}", file=sys.stderr)
        print_result(summary)
        print(f"  results in {out}/ (summary.json, metrics.jsonl, curves.png, timeline.json)")
        if summary["checkpoint"] is not None:
            print(f"  checkpoint in {summary['checkpoint']} (--resume continues it)")


def build_summary(args, everyone: Sequence[dict], rows: Sequence[dict], wall: float,
                  final_accuracy: float, stop_reason: Optional[str], plan,
                  ranks: Optional[int] = None) -> dict:
    """summary.json: the job, the outcome, and every rank's counters (`everyone`)."""
    counters = [r["counters"] for r in everyone]
    ckpt = (None if args.checkpoint_dir is None
            else os.path.abspath(checkpoint_path(args.checkpoint_dir)))
    return {
        "strategy": args.strategy, "ranks": len(everyone) if ranks is None else ranks,
        "model": args.model,
        "dataset": args.dataset, "seed": args.seed, "batch_size": args.batch_size, "lr": args.lr,
        "compute_slowdown": [r["compute_factor"] for r in everyone],
        "link": [r["link"] for r in everyone],
        "target_accuracy": args.target_accuracy, "max_seconds": args.max_seconds,
        "max_commits": args.max_commits,
        "time_to_target_s": time_to_target(rows, args.target_accuracy),
        "final_accuracy": final_accuracy,
        "wall_s": wall,
        "utilization": [r["counters"].get("compute_s", 0.0) / max(r["wall_s"], 1e-9)
                        for r in everyone],
        # training or evaluating (rank 0 evaluates for the curves and the target): not waiting
        "busy": [(r["counters"].get("compute_s", 0.0) + r.get("evaluator_s", 0.0))
                 / max(r["wall_s"], 1e-9) for r in everyone],
        "bytes_sent": int(sum(c["bytes_sent"] for c in counters)),
        "commits": int(sum(c.get("commits") or 0 for c in counters)),
        "local_steps": int(sum(c.get("local_steps") or 0 for c in counters)),
        "evaluations": len(rows),
        "stop_reason": stop_reason,
        "fault_tolerant": bool(getattr(args, "fault_tolerant", False)),
        "transport": counters[0].get("transport") if counters else None,
        "overlap": bool(counters and counters[0].get("overlap", {}).get("enabled")),
        # ranks a fault-tolerant run lost; in such a run per_rank holds rank 0 alone (the
        # others' counters would need a collective) and server.merged_by the rest
        "lost_ranks": counters[0].get("lost_ranks", []) if counters else [],
        "checkpoint": ckpt, "resumed": bool(args.resume),
        "plan": None if plan is None else _jsonable(plan.to_dict()),
        "per_rank": list(everyone),
        "files": {"metrics": "metrics.jsonl", "timeline": os.environ.get("ASHL_TIMELINE"),
                  "plot": "curves.png"},
    }


def print_result(summary: dict) -> None:
    ttt = summary["time_to_target_s"]
    print(f"{summary['strategy']}: {_ranks(summary['ranks'])}, final accuracy "
          f"{summary['final_accuracy']:.4f}, time to target "
          f"{'missed' if ttt is None else f'{ttt:.1f} s'}, wall {summary['wall_s']:.1f} s, "
          f"commits {summary['commits']}, "
          f"utilization {' '.join(f'{u:.0%}' for u in summary['utilization'])} "
          f"(busy {' '.join(f'{u:.0%}' for u in summary['busy'])}); "
          f"stop: {summary['stop_reason'] or 'n/a'}")


# ------------------------------------------------------------------------------ main
def _quiet(parser: argparse.ArgumentParser) -> None:
    parser.exit = lambda status=0, message=None: sys.exit(status)  # type: ignore[assignment]


def load_data(args):
    """The dataset (imports torch); a bad one is an OptionError naming --dataset."""
    import torch
    torch.set_num_threads(1)
    from .data import load_dataset
    try:
        return load_dataset(args.dataset)
    except (ValueError, OSError) as e:
        raise OptionError(f"--dataset {args.dataset!r}: {e}") from None


def make_dir(option: str, path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise OptionError(f"{option} {path!r}: cannot create the directory "
                          f"({e.strerror})") from None


def rank_device(spec: str, comm, alone: bool = False):
    """--device on this rank's host, made the process's current CUDA device when a GPU;
    one rank's refusal (a host without the GPU asked for) is every rank's, so none is left
    waiting in the first collective."""
    from .device import pick_device
    device, problem = None, None
    try:
        device = pick_device(spec, None if alone else comm)   # MPI's local rank: exact
    except ValueError as exc:
        problem = f"--device: rank {comm.Get_rank()}: {exc}"
    problems = [problem] if alone else comm.allgather(problem)
    first = next((p for p in problems if p), None)
    if first is not None:
        raise OptionError(first)
    if device.type == "cuda":   # default-device allocations, NCCL's and Horovod's: its GPU
        import torch
        torch.cuda.set_device(device)
    return device


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    env_rank = _env_int(_RANK_VARS) or 0
    if env_rank != 0:
        _quiet(parser)    # under a launcher every rank validates; rank 0 alone says why
    args = parser.parse_args(argv)
    with parser.checking():
        check_options(args)
        check_model(args)
        if env_rank == 0:
            make_dir("--out", args.out)
        if args.checkpoint_dir is not None:   # every rank writes its part there
            make_dir("--checkpoint-dir", args.checkpoint_dir)
        data = load_data(args)

    from mpi4py import MPI
    if args.strategy not in PARAMETER_SERVER:   # their rounds are Horovod collectives
        import horovod.torch as hvd
        hvd.init(comm=MPI.COMM_WORLD)
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if rank != 0:   # every rank reaches the same verdict; one prints it
        _quiet(parser)
    joining = bool(os.environ.get("ASHL_JOIN"))   # a replacement: alone, its rank comes later
    with parser.checking():
        if not joining:
            check_rank_count(args, size)
        args.torch_device = rank_device(args.device, MPI.COMM_WORLD, alone=joining)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    # Every rank agrees on the path: writing the trace is a gather.
    os.environ.setdefault("ASHL_TIMELINE", os.path.abspath(os.path.join(args.out, "timeline.json")))
    with parser.checking():   # --resume's refusal, reached alike on every rank
        return Run(args, data, rank, size, MPI.COMM_WORLD, lead=not joining).execute()


if __name__ == "__main__":
    sys.exit(main())
