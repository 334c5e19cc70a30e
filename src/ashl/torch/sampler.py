"""HeterogeneousSampler: each rank reads its planned share of the dataset.

Like torch's DistributedSampler, every rank draws the same permutation of range(n) from
(seed, epoch) and reads a disjoint slice of it; unlike it, the slices are sized by the plan
(a fast rank gets more samples), so the union over ranks of one epoch is one permutation
of the dataset: each sample is used once per global epoch.

Two exceptions, both DistributedSampler's own (without ``drop_last``): equal shares of a
dataset the ranks do not divide are padded to equal counts, and a rank whose share rounds to
no sample reads one, by reading on past the permutation's end from its start. A lockstep
strategy (bsp) needs every rank to take the same number of steps per epoch, and a rank with
no step in an epoch would leave the others waiting for it.

Shares change when the plan changes. A change never touches an iteration already running
(its indices are fixed when it starts); it applies from the next epoch boundary, or from an
explicit epoch (`set_shares(shares, epoch=e)`).
"""
from __future__ import annotations

import math
import numbers
import sys
from fractions import Fraction
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

__all__ = ["HeterogeneousSampler", "shares_to_counts", "padded_counts"]


def _world() -> tuple[int, int]:
    """(size, rank) from an initialised Horovod, else an initialised MPI, else (1, 0).

    Only modules the program already imported are asked (``import ashl.torch`` has
    imported mpi4py.MPI; horovod.torch is the script's to import).
    """
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None:
        try:
            if hvd.is_initialized():
                return hvd.size(), hvd.rank()
        except Exception:  # an uninitialised/failed Horovod: fall through
            pass
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_size(), mpi.COMM_WORLD.Get_rank()
    return 1, 0


def _tolist(shares):
    return shares.tolist() if hasattr(shares, "tolist") else shares  # numpy array / tensor


def shares_to_counts(shares: Sequence, n: int, num_replicas: int, drop_last: bool = False) -> tuple[int, ...]:
    """Samples per rank for `shares` of a dataset of `n`.

    Integers (int / numpy integers) are counts and must sum to n. Any other real numbers
    (floats, Fractions) are fractions: non-negative, summing to 1 (floats within 1e-6; they
    are then normalised). Fractions become counts by largest remainder (floor, then one more
    to the largest remainders, ties to the lower rank: ashl.planner.largest_remainder's
    rule), so they sum to n; with `drop_last`, only the floors are kept and the fewer than
    `num_replicas` leftover samples are skipped that epoch.
    """
    shares = _tolist(shares)
    if isinstance(shares, (str, bytes)) or not isinstance(shares, Sequence):
        raise ValueError(f"shares must be a list of numbers, got {type(shares).__name__}")
    shares = list(shares)
    if len(shares) != num_replicas:
        raise ValueError(f"shares has {len(shares)} entries but there are {num_replicas} ranks")
    for i, s in enumerate(shares):
        if isinstance(s, bool) or not isinstance(s, numbers.Real):
            raise ValueError(f"shares[{i}] is not a number: {s!r}")
        if not s >= 0 or math.isinf(s):
            raise ValueError(f"shares[{i}] must be a finite number >= 0, got {s!r}")
    if all(isinstance(s, numbers.Integral) for s in shares):
        counts = tuple(int(s) for s in shares)
        if sum(counts) != n:
            raise ValueError(f"integer shares are sample counts and must sum to the dataset size {n}, "
                             f"got {sum(counts)} (pass fractions like 0.25 for proportions)")
        return counts
    # Fraction(float) is exact: no rounding drift; numpy's floats go through float
    exact = [Fraction(s) if isinstance(s, (numbers.Rational, float)) else Fraction(float(s))
             for s in shares]
    total = sum(exact)
    if total == 0 or abs(total - 1) > Fraction(1, 10**6):
        raise ValueError(f"fractional shares must sum to 1, got {float(total):.9g}")
    quotas = [x / total * n for x in exact]
    counts = [int(q) for q in quotas]  # floor: quotas are >= 0
    if not drop_last:
        order = sorted(range(num_replicas), key=lambda i: (-(quotas[i] - counts[i]), i))
        for i in order[:n - sum(counts)]:
            counts[i] += 1
    return tuple(counts)


def padded_counts(counts: Sequence[int], n: int, equal: bool) -> tuple[int, ...]:
    """`counts` (an exact partition of n) padded as DistributedSampler pads: to
    ceil(n / ranks) each for `equal` shares, and to at least one sample per rank."""
    if n == 0:
        return tuple(counts)
    if equal:
        return (-(-n // len(counts)),) * len(counts)
    return tuple(max(c, 1) for c in counts)


def _epoch_seed(seed: int, epoch: int) -> int:
    """A generator seed for (seed, epoch); unlike seed + epoch, (0, 1) and (1, 0) differ."""
    state = np.random.SeedSequence([seed & (2**64 - 1), epoch]).generate_state(2, np.uint32)
    return (int(state[0]) << 32 | int(state[1])) & (2**63 - 1)


class HeterogeneousSampler(Sampler[int]):
    """Gives each rank its planned share of `dataset`, disjoint and deterministic.

    Args:
        dataset: anything with len().
        num_replicas, rank: default from Horovod (if initialised), else mpi4py's COMM_WORLD
            (if initialised), else 1 and 0.
        shares: per-rank fractions summing to 1, or integer counts summing to len(dataset);
            default equal shares.
        shuffle: permute with a generator seeded from (seed, epoch) (same on every rank).
        seed: must be the same on every rank.
        drop_last: skip the (< num_replicas) samples fractional shares cannot place exactly,
            instead of giving them to the ranks with the largest remainders; nothing is
            padded (without it, equal shares are padded to equal counts and every rank
            reads at least one sample, as with DistributedSampler).

    Call `set_epoch(e)` before each epoch, as with DistributedSampler.
    """

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, *,
                 shares: Sequence | None = None):
        if num_replicas is None or rank is None:
            size, r = _world()
            num_replicas = size if num_replicas is None else num_replicas
            rank = r if rank is None else rank
        for name, v in (("num_replicas", num_replicas), ("rank", rank), ("seed", seed)):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        try:
            n = len(dataset)
        except TypeError:
            raise ValueError(f"dataset must have a length, got {type(dataset).__name__}") from None
        self.dataset = dataset
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.n = n
        self.epoch = 0
        self.epochs_told = False  # has set_epoch been called? (else every pass is epoch 0)
        # (first epoch, counts) in increasing epoch order; counts for epoch e come from the
        # last entry whose first epoch is <= e.
        self._schedule: list[tuple[int, tuple[int, ...]]] = []
        self._started = False  # has an iteration of self.epoch begun?
        self._read: dict[int, set[tuple[int, ...]]] = {}   # epoch -> the counts its passes read
        self._pending: tuple[int, ...] | None = None  # counts waiting for the next boundary
        self._on_iteration: list = []   # called when a pass over the data begins
        self._on_exhausted: list = []   # called when a pass has handed out all its indices
        if shares is None:
            shares = [Fraction(1, self.num_replicas)] * self.num_replicas
        self._schedule.append((0, self._counts(shares)))

    def _counts(self, shares: Sequence) -> tuple[int, ...]:
        """Samples per rank for `shares`: the exact partition, padded unless drop_last."""
        counts = shares_to_counts(shares, self.n, self.num_replicas, self.drop_last)
        values = list(_tolist(shares))
        if self.drop_last or all(isinstance(x, numbers.Integral) for x in values):
            return counts       # (integer shares are the user's own counts)
        return padded_counts(counts, self.n, equal=all(x == values[0] for x in values))

    def rebind(self, rank: int, num_replicas: int) -> None:
        """Become rank `rank` of `num_replicas` (a replacement that took a lost rank's slot);
        equal shares until set_shares, from the next epoch boundary (a pass already running
        keeps its indices)."""
        if isinstance(rank, bool) or isinstance(num_replicas, bool) or not (
                isinstance(num_replicas, numbers.Integral) and num_replicas >= 1
                and isinstance(rank, numbers.Integral) and 0 <= rank < num_replicas):
            raise ValueError(f"rank {rank!r} of {num_replicas!r} replicas is not a rank")
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        equal = self._counts([Fraction(1, self.num_replicas)] * self.num_replicas)
        self._schedule, self._pending = [(0, equal)], None
        self._read.clear()     # passes read alone, before it joined, are not the run's

    # --- plan ------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        self.epochs_told = True
        if epoch != self.epoch:
            self._started = False
            if self._pending is not None:
                self._apply(self._pending, int(epoch))
        self.epoch = int(epoch)

    def set_shares(self, shares: Sequence, epoch: int | None = None) -> None:
        """Use `shares` from `epoch` on, or by default from the next epoch boundary.

        The next boundary is now if no iteration of the current epoch has begun, else the
        next `set_epoch` to another epoch or, if that never comes, the next `iter()`. An
        iteration already running keeps its indices. Shares scheduled for later epochs are
        replaced (the latest call wins). Validated immediately.
        """
        counts = self._counts(shares)
        if epoch is None:
            self._pending = None
            if self._started:
                self._pending = counts
            else:
                self._apply(counts, self.epoch)
            return
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        self._pending = None
        self._apply(counts, int(epoch))

    def _apply(self, counts: tuple[int, ...], epoch: int) -> None:
        self._schedule = [(e, c) for e, c in self._schedule if e < epoch] + [(epoch, counts)]
        self._pending = None

    def state_dict(self) -> dict:
        """The shares schedule, as sample counts from each epoch on (what a checkpoint keeps:
        a resumed loop reads every epoch with the counts the saved run would have). Shares
        waiting for the next boundary are placed there: the epoch after one begun."""
        schedule = list(self._schedule)
        if self._pending is not None:
            at = self.epoch + 1 if self._started else self.epoch
            schedule = [(e, c) for e, c in schedule if e < at] + [(at, self._pending)]
        return {"n": self.n, "num_replicas": self.num_replicas,
                "schedule": [(e, list(c)) for e, c in schedule]}

    def load_state_dict(self, state: dict) -> None:
        """Take a saved schedule (before the loop's first pass); one saved for another
        dataset size or rank count is refused."""
        if (state.get("n"), state.get("num_replicas")) != (self.n, self.num_replicas):
            raise ValueError(f"the sampler state is for {state.get('n')} samples on "
                             f"{state.get('num_replicas')} ranks; this sampler has {self.n} "
                             f"on {self.num_replicas}")
        self._schedule = [(int(e), tuple(int(x) for x in c)) for e, c in state["schedule"]]
        self._pending = None

    def comes_late(self, shares: Sequence, epoch: int) -> bool:
        """Would `shares` from `epoch` on change a pass this rank has already begun? (Shares
        that give the counts it reads anyway change nothing, whenever they come.)"""
        counts = self._counts(shares)
        return any(read != counts for e, passes in self._read.items() if e >= epoch
                   for read in passes)

    def counts(self, epoch: int | None = None) -> tuple[int, ...]:
        """Samples per rank in `epoch` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        chosen = self._schedule[0][1]
        for first, counts in self._schedule:
            if first <= epoch:
                chosen = counts
        return chosen

    # --- sampling ------------------------------------------------------------------

    def indices(self, epoch: int | None = None) -> list[int]:
        """This rank's indices for `epoch` (default: the current one), in reading order."""
        epoch = self.epoch if epoch is None else epoch
        counts = self.counts(epoch)
        start = sum(counts[:self.rank])
        stop = start + counts[self.rank]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(_epoch_seed(self.seed, epoch))
            order = torch.randperm(self.n, generator=g)
        else:
            order = torch.arange(self.n)
        if sum(counts) > self.n:     # padded: read on from the permutation's start
            order = order.repeat(-(-sum(counts) // self.n))
        return order[start:stop].tolist()

    def on_iteration(self, callback) -> None:
        """Call `callback()` whenever a pass over the data begins (the optimizer's step clock
        restarts there: what the script did between two epochs is not a training step)."""
        self._on_iteration.append(callback)

    def on_exhausted(self, callback) -> None:
        """Call `callback()` when a pass has handed out its last index, as the loader asks for
        the next one (the averaging strategies' epoch join: every rank leaves its epoch at the
        same collective). A pass the consumer abandons early does not call it."""
        self._on_exhausted.append(callback)

    def __iter__(self) -> Iterator[int]:
        if self._pending is not None:
            self._apply(self._pending, self.epoch)
        self._started = True
        self._read.setdefault(self.epoch, set()).add(self.counts())
        for callback in self._on_iteration:
            callback()
        return self._pass(self.indices())  # fixed now: later set_shares cannot change it

    def _pass(self, indices: list) -> Iterator[int]:
        yield from indices
        for callback in self._on_exhausted:
            callback()

    def __len__(self) -> int:
        return self.counts()[self.rank]

    def __repr__(self) -> str:
        return (f"HeterogeneousSampler(n={self.n}, rank={self.rank}/{self.num_replicas}, "
                f"counts={self.counts()}, epoch={self.epoch})")
