"""``python -m ashl.train``: the per-rank main job. Launch it on every rank:

    mpirun -np 4 --oversubscribe --bind-to none python -m ashl.train --strategy ashl \\
        --compute-slowdown 1,1,2,4 --link-slowdown 1,1,2,4 --target-accuracy 0.93 --out out/train
    horovodrun -np 4 python -m ashl.train --strategy bsp --model cnn

Every rank trains with ``ashl.torch.DistributedOptimizer`` (any strategy of
``ashl.strategies.STRATEGIES``) on an embedded dataset; rank 0 evaluates the test accuracy
(the ``evaluate=`` callback, so the run can stop on ``--target-accuracy``), shows a progress
line on stderr and writes to ``--out``:

    metrics.jsonl   one line per evaluation: t (seconds since the start, profiling
                    included), stage, loss (rank 0's training loss, smoothed), accuracy,
                    commits (the run's total where the strategy knows it, else rank 0's)
    summary.json    strategy, ranks, time_to_target_s (null if missed), final_accuracy,
                    wall_s, utilization per rank (compute_s / wall_s), bytes_sent, commits,
                    the plan, every rank's counters, the stop reason
    timeline.json   the Chrome trace of the run (ASHL_TIMELINE, unless set by the user)
    curves.png      accuracy and loss against wall time

Options are checked before MPI starts where possible; a bad one ends the run with one line
``ashl.train: error: ...`` naming it, and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Optional, Sequence

from .emulation import DEFAULT_LINK, Heterogeneity, Link
from .strategies import STRATEGIES

PROG = "ashl.train"
DATASET_HELP = "digits (default), synthetic[:N], cifar10:DIR"
# Rank count / rank as the launchers export them (checked again after MPI starts).
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line (``ashl.train: error: ...``) and exit status 2."""

    def error(self, message: str):  # noqa: D401 (argparse API)
        self.exit(2, f"{self.prog}: error: {message.splitlines()[0] if message else message}"
                     f" (see --help)\n")


# ------------------------------------------------------------------------------ options
def build_parser(prog: str = PROG) -> OneLineParser:
    p = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--strategy", default="ashl", help=f"one of {', '.join(STRATEGIES)}")
    p.add_argument("--model", default="mlp",
                   help="mlp, cnn (small images such as digits); resnet18, vgg16 (32x32 images)")
    p.add_argument("--dataset", default="digits", help=DATASET_HELP)
    p.add_argument("--compute-slowdown", default=None, metavar="F0,F1,...",
                   help="per-rank compute slowdown factors >= 1 (missing ranks: 1); off by default")
    p.add_argument("--link-slowdown", default=None, metavar="F0,F1,...",
                   help="per-rank link slowdown factors >= 1 of the --link-base link; off by default")
    p.add_argument("--link-base", default=None, metavar="LATENCY_S,BYTES_PER_S",
                   help=f"the factor-1 emulated link (default {DEFAULT_LINK.latency_s:g} s, "
                        f"{DEFAULT_LINK.bytes_per_s:g} B/s); alone it emulates that link on every rank")
    p.add_argument("--target-accuracy", type=float, default=None,
                   help="stop once rank 0's test accuracy reaches this (0 < a <= 1)")
    p.add_argument("--max-seconds", type=float, default=120.0,
                   help="time budget of the run, profiling included")
    p.add_argument("--max-commits", type=int, default=None, help="commit budget (all ranks)")
    p.add_argument("--switch-loss", type=float, default=0.3,
                   help="ASHL: move from AHL to SHL below this global training loss")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--eval-every", type=float, default=None, metavar="SECONDS",
                   help="rank 0 evaluates at most this often (default: 0.25 s on digits and "
                        "synthetic data, 10 s on CIFAR-10)")
    p.add_argument("--profile-steps", type=int, default=10,
                   help="local steps each rank times before the plan")
    p.add_argument("--out", default=os.path.join("out", "train"), help="output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p


def parse_factors(parser: OneLineParser, option: str, text: Optional[str]) -> list[float]:
    """'1,2,4' -> [1.0, 2.0, 4.0]; any malformed item is an error naming the option."""
    if text is None:
        return []
    items = text.split(",")
    factors = []
    for item in items:
        item = item.strip()
        try:
            value = float(item)
        except ValueError:
            parser.error(f"{option} {text!r}: {item!r} is not a number (expected comma-separated "
                         "factors >= 1, one per rank, e.g. 1,1,2,4)")
        if not math.isfinite(value) or value < 1:
            parser.error(f"{option} {text!r}: {item} is not a finite factor >= 1")
        factors.append(value)
    return factors


def parse_link(parser: OneLineParser, text: Optional[str]) -> Link:
    if text is None:
        return DEFAULT_LINK
    parts = text.split(",")
    try:
        latency, bandwidth = (float(x) for x in parts)
    except ValueError:
        parser.error(f"--link-base {text!r}: expected LATENCY_S,BYTES_PER_S (e.g. 5e-4,125e6)")
    try:
        return Link(latency, bandwidth)
    except ValueError as e:
        parser.error(f"--link-base {text!r}: {e}")


def check_dataset_spec(parser: OneLineParser, spec: str) -> tuple[int, ...]:
    """Syntax and directory of --dataset (no data read); returns the input shape."""
    name, sep, arg = spec.partition(":")
    name = name.strip().lower()
    if name == "digits":
        if sep:
            parser.error(f"--dataset {spec!r}: digits takes no argument")
        return (1, 8, 8)
    if name == "synthetic":
        if sep:
            try:
                n = int(arg)
            except ValueError:
                parser.error(f"--dataset {spec!r}: synthetic:N needs an integer sample count N")
            if n < 20:
                parser.error(f"--dataset {spec!r}: synthetic needs N >= 20 samples (2 per class)")
        return (1, 8, 8)
    if name == "cifar10":
        if not arg:
            parser.error(f"--dataset {spec!r}: cifar10 needs a directory, cifar10:DIR")
        if not os.path.isdir(arg):
            parser.error(f"--dataset {spec!r}: directory {arg!r} does not exist")
        return (3, 32, 32)
    parser.error(f"--dataset {spec!r}: unknown dataset (known: {DATASET_HELP})")


def _env_int(names: Sequence[str]) -> Optional[int]:
    for name in names:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return None


def check_rank_count(parser: OneLineParser, args, size: int) -> None:
    for option, factors in (("--compute-slowdown", args.compute_factors),
                            ("--link-slowdown", args.link_factors)):
        if len(factors) > size:
            parser.error(f"{option} {getattr(args, option[2:].replace('-', '_'))!r} lists "
                         f"{len(factors)} factors but the run has {size} rank"
                         f"{'s' if size != 1 else ''}")


def validate(parser: OneLineParser, args) -> argparse.Namespace:
    """Everything that needs neither MPI nor torch; fills in parsed values."""
    if args.strategy not in STRATEGIES:
        parser.error(f"--strategy {args.strategy!r}: unknown strategy "
                     f"(known: {', '.join(STRATEGIES)})")
    args.compute_factors = parse_factors(parser, "--compute-slowdown", args.compute_slowdown)
    args.link_factors = parse_factors(parser, "--link-slowdown", args.link_slowdown)
    args.link = parse_link(parser, args.link_base)
    if args.link_base is not None and not args.link_factors:
        args.link_factors = [1.0]   # an explicit link alone: every rank gets it (factor 1)
    if args.max_seconds is not None and not (math.isfinite(args.max_seconds) and args.max_seconds > 0):
        parser.error(f"--max-seconds {args.max_seconds:g}: the time budget must be a finite "
                     "number of seconds > 0")
    if args.max_commits is not None and args.max_commits < 1:
        parser.error(f"--max-commits {args.max_commits}: the commit budget must be >= 1")
    if args.target_accuracy is not None and not (0 < args.target_accuracy <= 1):
        parser.error(f"--target-accuracy {args.target_accuracy:g}: must be in (0, 1] "
                     "(a fraction, not a percentage)")
    if not math.isfinite(args.switch_loss):
        parser.error(f"--switch-loss {args.switch_loss:g}: must be a finite number")
    if args.batch_size < 1:
        parser.error(f"--batch-size {args.batch_size}: must be >= 1")
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr {args.lr:g}: the learning rate must be a finite number > 0")
    if args.seed < 0:
        parser.error(f"--seed {args.seed}: must be >= 0")
    if args.eval_every is None:
        args.eval_every = 10.0 if args.dataset.strip().lower().startswith("cifar10") else 0.25
    if not (math.isfinite(args.eval_every) and args.eval_every >= 0):
        parser.error(f"--eval-every {args.eval_every:g}: must be a number of seconds >= 0")
    if args.profile_steps < 3:
        parser.error(f"--profile-steps {args.profile_steps}: must be >= 3 (one is warm-up)")
    if args.max_seconds is None and args.max_commits is None and args.target_accuracy is None:
        parser.error("no stop condition: give --max-seconds, --max-commits or --target-accuracy")
    args.input_shape = check_dataset_spec(parser, args.dataset)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out!r}: exists and is not a directory")
    size = _env_int(_SIZE_VARS)
    if size is not None:
        check_rank_count(parser, args, size)
    return args


def check_model(parser: OneLineParser, args) -> None:
    """--model against the known models and the dataset's input shape (imports torch)."""
    from .models import MODELS, build_model
    key = args.model.strip().lower().replace("-", "").replace("_", "")
    if key not in MODELS:
        parser.error(f"--model {args.model!r}: unknown model (known: {', '.join(MODELS)})")
    if key in ("resnet18", "vgg16") and tuple(args.input_shape[1:]) != (32, 32):
        parser.error(f"--model {args.model!r} is built for 32x32 images and --dataset "
                     f"{args.dataset!r} has {'x'.join(map(str, args.input_shape[1:]))}: "
                     "use --model mlp or cnn, or --dataset cifar10:DIR")
    try:
        import torch
        with torch.device("meta"):   # the shape check only: no memory
            build_model(key, args.input_shape, 10)
    except ValueError as e:
        parser.error(f"--model {args.model!r}: {e}")
    args.model = key


# ------------------------------------------------------------------------------ helpers
def global_commits(strategy) -> Optional[int]:
    """The run's total commit count where the strategy keeps one (rank 0), else None."""
    machine = getattr(strategy, "machine", None)          # a stage machine of its own
    if machine is None:                                    # or the coordinator's (server)
        mc = getattr(strategy, "mc", None)
        machine = getattr(getattr(mc, "coordinator", None), "machine", None)
    commits = getattr(machine, "commits", None)
    return int(commits) if isinstance(commits, int) else None


def stop_reason(strategy, counters: dict) -> Optional[str]:
    reason = counters.get("stop_reason") or getattr(strategy, "stop_reason", None)
    if not reason:
        mc = getattr(strategy, "mc", None)
        machine = getattr(getattr(mc, "coordinator", None), "machine", None)
        reason = getattr(machine, "stop_reason", None)
    if not reason:
        machine = getattr(strategy, "machine", None)
        reason = getattr(machine, "stop_reason", None)
    return str(reason) if reason else None


def bytes_sent(counters: dict) -> int:
    """Bytes a rank put on the wire: bytes_sent, else what it allreduced (ashl-sync)."""
    value = counters.get("bytes_sent")
    if value is None:
        value = counters.get("bytes_allreduced")
    return int(value or 0)


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


# ------------------------------------------------------------------------------ the job
def _quiet(parser: argparse.ArgumentParser) -> None:
    parser.exit = lambda status=0, message=None: sys.exit(status)  # type: ignore[assignment]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    if (_env_int(_RANK_VARS) or 0) != 0:
        _quiet(parser)    # under a launcher every rank validates; rank 0 alone says why
    args = validate(parser, parser.parse_args(argv))
    check_model(parser, args)
    env_rank = _env_int(_RANK_VARS) or 0
    if env_rank == 0:
        try:
            os.makedirs(args.out, exist_ok=True)
        except OSError as e:
            parser.error(f"--out {args.out!r}: cannot create the directory ({e.strerror})")

    import torch
    torch.set_num_threads(1)
    from .data import load_dataset
    try:
        data = load_dataset(args.dataset)
    except (ValueError, OSError) as e:
        parser.error(f"--dataset {args.dataset!r}: {e}")

    from mpi4py import MPI
    import horovod.torch as hvd
    hvd.init(comm=MPI.COMM_WORLD)
    rank, size = hvd.rank(), hvd.size()
    if rank != 0:   # every rank reaches the same verdict; one prints it
        _quiet(parser)
    check_rank_count(parser, args, size)
    return train(args, data, rank, size, hvd, MPI)


def train(args, data, rank: int, size: int, hvd, MPI) -> int:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    import ashl.torch as ashl
    from .models import build_model
    from .stages import StageConfig

    out = args.out
    if rank == 0:
        os.makedirs(out, exist_ok=True)
    metrics_path = os.path.join(out, "metrics.jsonl")
    # Every rank agrees on the path: writing the trace is a gather.
    os.environ.setdefault("ASHL_TIMELINE", os.path.abspath(os.path.join(out, "timeline.json")))

    torch.manual_seed(args.seed)
    model = build_model(args.model, data.input_shape, data.classes)
    base_opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = ashl.HeterogeneousSampler(data.train, seed=args.seed)
    hetero = Heterogeneity.for_rank(rank, args.compute_factors, args.link_factors, args.link)
    test_x, test_y = data.test.tensors

    state = {"opt": None, "loss": None, "last_eval": None, "accuracy": None, "evals": 0}
    metrics = open(metrics_path, "w") if rank == 0 else None

    def accuracy() -> float:
        was_training = model.training
        with torch.no_grad():
            model.eval()
            correct = 0
            for i in range(0, len(test_y), 2048):
                correct += (model(test_x[i:i + 2048]).argmax(1) == test_y[i:i + 2048]).sum().item()
            model.train(was_training)
        return correct / max(1, len(test_y))

    def record(acc: float, source: str) -> None:
        opt = state["opt"]
        now = time.perf_counter()
        commits = None
        stage = "PROFILE"
        if opt is not None:
            stage = opt.stage
            commits = global_commits(opt.strategy)
            if commits is None:
                commits = int(opt.strategy.commits) if hasattr(opt.strategy, "commits") else None
        row = {"t": round(now - start, 4), "stage": stage, "loss": state["loss"],
               "accuracy": acc, "commits": commits, "by": source}
        metrics.write(json.dumps(row) + "\n")
        metrics.flush()
        state.update(last_eval=now, accuracy=acc, evals=state["evals"] + 1)

    def evaluate() -> float:
        """The strategy's callback (rank 0): test accuracy of the model it just received."""
        acc = accuracy()
        record(acc, "strategy")
        return acc

    stage_config = StageConfig(switch_loss=args.switch_loss, target_accuracy=args.target_accuracy,
                               max_seconds=args.max_seconds, max_commits=args.max_commits)
    config = dict(stage_config=stage_config, eval_every_s=args.eval_every,
                  profile_steps=args.profile_steps)
    if rank == 0:
        config["evaluate"] = evaluate
    # Ranks finish importing and loading at different times (a loaded host skews them by
    # seconds): line them up, so the first collective does not charge that to the strategy.
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()      # the run's clock: profiling included
    try:
        opt = ashl.DistributedOptimizer(base_opt, model=model, sampler=sampler,
                                        strategy=args.strategy, heterogeneity=hetero, **config)
    except TypeError as e:
        if "heterogeneity" not in str(e):
            raise
        # A strategy without the parameter reads the same emulation from the environment.
        os.environ["ASHL_EMULATE_COMPUTE"] = ",".join(map(str, args.compute_factors))
        os.environ["ASHL_EMULATE_LINK"] = ",".join(map(str, args.link_factors))
        os.environ["ASHL_EMULATE_LINK_BASE"] = f"{args.link.latency_s!r},{args.link.bytes_per_s!r}"
        opt = ashl.DistributedOptimizer(base_opt, model=model, sampler=sampler,
                                        strategy=args.strategy, **config)
    state["opt"] = opt
    ashl.broadcast_parameters(model.state_dict(), root_rank=0)
    if rank == 0:
        record(accuracy(), "start")   # the curves start from the initial model

    progress = Progress(rank == 0 and not args.no_progress, args.strategy)
    # A strategy that never calls evaluate still gets curves: rank 0 evaluates its own model
    # when the strategy has been silent for this long (it cannot stop the run by itself).
    fallback_after = max(2.0, 3 * args.eval_every)

    def describe() -> str:
        wall = time.perf_counter() - start
        c = opt.counters()
        commits = global_commits(opt.strategy)
        if commits is None:
            commits = c.get("commits", 0)
        acc = state["accuracy"]
        loss = state["loss"]
        return (f"{opt.stage} loss {'-' if loss is None else f'{loss:.3f}'} "
                f"acc {'-' if acc is None else f'{acc:.3f}'} "
                f"{commits / max(wall, 1e-9):.1f} commits/s "
                f"util {c.get('compute_s', 0.0) / max(wall, 1e-9):.0%}")

    epoch = 0
    while not opt.finished:
        sampler.set_epoch(epoch)
        if hasattr(opt.strategy, "set_epoch"):
            opt.set_epoch(epoch)
        for x, y in DataLoader(data.train, batch_size=args.batch_size, sampler=sampler):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step(loss=loss)
            if rank == 0:
                value = float(loss.detach())
                if math.isfinite(value):
                    prev = state["loss"]
                    state["loss"] = value if prev is None else 0.9 * prev + 0.1 * value
                now = time.perf_counter()
                since = now - (state["last_eval"] if state["last_eval"] is not None else start)
                if since > fallback_after and not opt.finished:
                    record(accuracy(), "loop")
                progress.step(now, describe)
            if opt.finished:
                break
        epoch += 1
    opt.finish()
    end = time.perf_counter()
    wall = end - start

    counters = _jsonable(opt.counters())
    final_accuracy = accuracy() if rank == 0 else None
    reason = stop_reason(opt.strategy, counters) if rank == 0 else None
    mine = {"rank": rank, "wall_s": wall, "counters": counters,
            "compute_factor": hetero.compute_factor,
            "link": None if hetero.link is None else [hetero.link.latency_s, hetero.link.bytes_per_s]}
    everyone = MPI.COMM_WORLD.gather(mine, root=0)
    if rank != 0:
        return 0

    record(final_accuracy, "final")
    metrics.close()
    progress.close(f"done: acc {final_accuracy:.3f}")
    rows = read_metrics(metrics_path)
    ttt = time_to_target(rows, args.target_accuracy)
    plan = getattr(opt, "plan", None)
    summary = {
        "strategy": args.strategy,
        "ranks": size,
        "model": args.model,
        "dataset": args.dataset,
        "seed": args.seed,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "compute_slowdown": [r["compute_factor"] for r in everyone],
        "link": [r["link"] for r in everyone],
        "target_accuracy": args.target_accuracy,
        "max_seconds": args.max_seconds,
        "max_commits": args.max_commits,
        "time_to_target_s": ttt,
        "final_accuracy": final_accuracy,
        "wall_s": wall,
        "utilization": [r["counters"].get("compute_s", 0.0) / max(r["wall_s"], 1e-9)
                        for r in everyone],
        "bytes_sent": int(sum(bytes_sent(r["counters"]) for r in everyone)),
        "commits": int(sum(r["counters"].get("commits") or 0 for r in everyone)),
        "local_steps": int(sum(r["counters"].get("local_steps") or 0 for r in everyone)),
        "evaluations": len(rows),
        "stop_reason": reason,
        "plan": _jsonable(plan.to_dict()) if plan is not None and hasattr(plan, "to_dict") else None,
        "per_rank": everyone,
        "files": {"metrics": "metrics.jsonl", "timeline": os.environ.get("ASHL_TIMELINE"),
                  "plot": "curves.png"},
    }
    tmp = os.path.join(out, "summary.json.tmp")
    with open(tmp, "w") as f:
        json.dump(_jsonable(summary), f, indent=1)
    os.replace(tmp, os.path.join(out, "summary.json"))
    title = (f"{args.strategy} on {size} rank{'s' if size != 1 else ''}, {args.model}/{args.dataset}, "
             f"compute x{','.join(f'{c:g}' for c in summary['compute_slowdown'])}")
    try:
        plot_curves(rows, os.path.join(out, "curves.png"), title, args.target_accuracy)
    except Exception as e:   # a plot is not worth losing the run's results
        print(f"{PROG}: could not draw the plot: {e}", file=sys.stderr)
    ttt_text = "missed" if ttt is None else f"{ttt:.1f} s"
    print(f"{args.strategy}: {size} rank{'s' if size != 1 else ''}, final accuracy {final_accuracy:.4f}, "
          f"time to target {ttt_text}, wall {wall:.1f} s, commits {summary['commits']}, "
          f"utilization {' '.join(f'{u:.0%}' for u in summary['utilization'])}; "
          f"stop: {reason or 'n/a'}")
    print(f"  results in {out}/ (summary.json, metrics.jsonl, curves.png, timeline.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
