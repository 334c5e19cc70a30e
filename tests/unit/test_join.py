"""finish()'s join told apart from a script's own hvd.join() (strategies/join.py), on the fake
world, whose join is Horovod's: a joined rank adds nothing to the others' allreduces until
every rank has joined, whichever join each called."""
import torch

from ashl.strategies.join import join_until_every_rank_finishes, wrap_scripts_join
from fake_world import FakeWorld


def metrics(hvd, value):
    t = torch.tensor([float(value)])
    hvd.allreduce_(t, op=hvd.Sum, name="metrics")
    return float(t[0])


def test_a_scripts_join_does_not_release_a_rank_that_has_finished():
    """Rank 0 left its loop early and waits in finish(); the others end an epoch with the
    script's hvd.join() and then allreduce their metrics: rank 0 must still be joined then
    (adding nothing), and leave only with the others' finish()."""
    def rank_fn(comm, hvd):
        wrap_scripts_join(hvd)
        if hvd.rank() == 0:
            join_until_every_rank_finishes(hvd)
            return "finished"
        hvd.join()                        # the script's, at its epoch's end
        seen = metrics(hvd, hvd.rank())   # rank 0 contributes nothing: 1 + 2
        hvd.join()                        # the next epoch's
        join_until_every_rank_finishes(hvd)
        return seen

    assert FakeWorld(3).run(rank_fn, timeout=20) == ["finished", 3.0, 3.0]


def test_every_rank_finishing_at_once_joins_and_counts_once_per_join():
    joins, counts = [], []

    def rank_fn(comm, hvd):
        joined, allreduce_ = hvd.join, hvd.allreduce_

        def counted_join(device=-1):
            joins.append(hvd.rank())
            return joined(device)

        def counted_allreduce_(tensor, op=hvd.Sum, name=None):
            if name == "ashl.join.finishing":
                counts.append(hvd.rank())
            return allreduce_(tensor, op=op, name=name)
        hvd.join, hvd.allreduce_ = counted_join, counted_allreduce_
        wrap_scripts_join(hvd)
        wrap_scripts_join(hvd)            # idempotent: one count per join
        hvd.join()
        join_until_every_rank_finishes(hvd)
        return metrics(hvd, 1)            # the ranks' collectives still line up after it

    assert FakeWorld(3).run(rank_fn, timeout=20) == [3.0, 3.0, 3.0]
    assert sorted(joins) == sorted(counts) == [0, 0, 1, 1, 2, 2]
