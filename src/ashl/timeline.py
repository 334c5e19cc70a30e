"""``ASHL_TIMELINE=path``: a Chrome-trace JSON of the run (open it in chrome://tracing or
Perfetto), as ``HOROVOD_TIMELINE`` does for Horovod. One process row per rank: ``compute``
spans (local steps between two commits), ``commit`` spans (push, server, any staleness wait,
pull), and instant events for plans, stage changes and evaluations.
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional, Sequence

ENV = "ASHL_TIMELINE"


class Timeline:
    """One rank's events; cheap enough to stay on for every run."""

    def __init__(self, rank: int):
        self.rank = rank
        self.events: list[dict] = []

    def span(self, name: str, start: float, end: float, **args) -> None:
        self.events.append({"name": name, "ph": "X", "pid": self.rank, "tid": 0,
                            "ts": start * 1e6, "dur": max(0.0, end - start) * 1e6, "args": args})

    def instant(self, name: str, **args) -> None:
        self.events.append({"name": name, "ph": "i", "s": "p", "pid": self.rank, "tid": 0,
                            "ts": time.time() * 1e6, "args": args})


def timeline_path() -> Optional[str]:
    return os.environ.get(ENV) or None


def write_chrome_trace(path: str, per_rank: Sequence[Sequence[dict]]) -> None:
    """Write every rank's events as one trace (atomically: temporary file, then rename)."""
    events = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}}
              for r in range(len(per_rank))]
    for rank_events in per_rank:
        events.extend(rank_events)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)
