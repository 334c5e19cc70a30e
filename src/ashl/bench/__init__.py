"""ashl's benchmark harness: ``python -m ashl.bench COMMAND ...``.

A subcommand is a module with ``add_arguments(parser)`` and ``run(args) -> int | None``; adding
one is one line in :data:`SUBCOMMANDS`. Only the chosen subcommand's module is imported, so a
subcommand may import heavy dependencies (torch, mpi4py) at module level.
"""
from __future__ import annotations

# name -> (module, one-line help)
SUBCOMMANDS = {
    "kernels": ("ashl.bench.kernels",
                "time the fused multi-tensor kernels against torch._foreach_* and flat torch ops"),
    "e2e": ("ashl.bench.e2e",
            "every strategy on the same emulated heterogeneous job: time to target, utilisation"),
    "scale": ("ashl.bench.scale",
              "the e2e scenario at 4, 8 and 16 ranks: throughput, commit latency, server load"),
    "script": ("ashl.bench.script",
               "a Horovod script against its three-line ashl conversion: accuracy, wall time"),
    "transport": ("ashl.bench.transport",
                  "the commit round trip against message size, over MPI and ZeroMQ side by side"),
}
