"""MPICoordinator.measure_link under mpirun: each rank times as many round trips as its
RoundTrips allow (a spent budget, or the most), the root serves each rank until told that
one was the last, the root follows what each rank's requests say a pull carries (a
message larger than the receive would be an MPI error), and the collectives after it still
line up. A rank that asks for another probe size than the root's times the root's (its
own would not fit the root's receive)."""
import json

from ashl.coordinator import MPICoordinator
from ashl.profiler import RoundTrips

mc = MPICoordinator()
counts = []
for trips in (RoundTrips(repeats=6, warmup=1, min_repeats=2, budget_s=0.0),
              RoundTrips(repeats=6, warmup=2, min_repeats=2, budget_s=60.0),
              RoundTrips(repeats=6, warmup=1, min_repeats=2, budget_s=0.0, probe_bytes=1000),
              # another probe size on every rank: each times the root's (1000 bytes)
              RoundTrips(repeats=6, warmup=1, min_repeats=2, budget_s=0.0,
                         probe_bytes=1000 + 2000 * mc.rank)):
    push, pull = mc.measure_link(1 << 16, trips)
    counts.append([push.count, pull.count])
every = mc.comm.gather(counts, root=mc.root)   # one line from the root: the ranks' own
if mc.is_root:                                   # prints could interleave on mpirun's stdout
    print("COUNTS " + json.dumps(every), flush=True)
mc.close()
