"""`python -m ashl.plan PROFILE.json`: preview the plan a cluster would get.

PROFILE.json holds per-rank times ({"ranks": [{"compute_s": ..., "push_s": ...,
"pull_s": ..., "compress_s": ...}, ...]}), optional planner "config" and "dataset_size";
see examples/profile.example.json and docs/PLANNER.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from .planner import AHL, SHL, Plan, PlannerConfig, load_profile_document, make_plan, pull_seconds, push_seconds

__all__ = ["format_plan", "main"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def format_plan(plan: Plan, dataset_size: int | None = None) -> str:
    """The plan as a human-readable table (one row per rank)."""
    cfg = plan.config
    out = [f"ashl plan v{plan.version}: {plan.n_ranks} ranks, k_AHL={cfg.k_ahl}, k_SHL={cfg.k_shl}, "
           f"SHL target ratio r0={cfg.shl_target_ratio:g}, sparse bytes factor={cfg.sparse_bytes_factor:g}, "
           f"weighting={cfg.weighting}, rounding={cfg.rounding}"]
    header = ["rank", "name", "step ms", "push ms", "pull ms", "H(AHL)", "H(SHL)", "R(SHL)",
              "D(AHL)", "D(SHL)", "w(AHL)", "w(SHL)", "idle AHL", "idle SHL"]
    if dataset_size is not None:
        header += ["samples AHL", "samples SHL"]
        counts = {s: plan.sample_counts(dataset_size, s) for s in (AHL, SHL)}
    rows = []
    for r, p in enumerate(plan.profiles):
        row = [str(r) + ("*" if r == plan.ahl.bottleneck else ""), p.name or "-",
               _ms(p.compute_s), _ms(push_seconds(p, 1.0, cfg)), _ms(pull_seconds(p, cfg)),
               str(plan.ahl.local_steps[r]), str(plan.shl.local_steps[r]), f"{plan.shl.ratios[r]:.4g}",
               f"{float(plan.ahl.shares[r]):.4f}", f"{float(plan.shl.shares[r]):.4f}",
               f"{float(plan.ahl.merge_weights[r]):.4f}", f"{float(plan.shl.merge_weights[r]):.4f}",
               f"{plan.ahl.idle_fraction[r]:.1%}", f"{plan.shl.idle_fraction[r]:.1%}"]
        if dataset_size is not None:
            row += [str(counts[AHL][r]), str(counts[SHL][r])]
        rows.append(row)
    out.append(_table(header, rows))
    for s in (plan.ahl, plan.shl):
        out.append(f"{s.stage}: round {_ms(s.round_s)} ms, bottleneck rank {s.bottleneck} "
                   f"(k={s.k}, ratio {s.target_ratio:g}), exact shares "
                   + " ".join(f"{f.numerator}/{f.denominator}" for f in s.shares))
    out.append("* = AHL bottleneck. Push ms is the dense push; D = data share; w = merge weight; "
               "idle = predicted idle fraction of the round.")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ashl.plan", description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="profile JSON (see examples/profile.example.json)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    parser.add_argument("--dataset-size", type=int, help="samples to split (overrides the file's)")
    parser.add_argument("--weighting", choices=["data_share", "uniform", "fednova"])
    parser.add_argument("--shl-target-ratio", type=float, help="r0 of the SHL bottleneck")
    args = parser.parse_args(argv)
    try:
        with open(args.profile) as f:
            doc = json.load(f)
        profiles, config, size = load_profile_document(doc)
        overrides = {k: v for k, v in (("weighting", args.weighting),
                                       ("shl_target_ratio", args.shl_target_ratio)) if v is not None}
        if overrides:
            config = PlannerConfig.from_dict({**config.to_dict(), **overrides})
        plan = make_plan(profiles, config, reason=f"preview of {args.profile}")
        size = args.dataset_size if args.dataset_size is not None else size
        text = plan.to_json(indent=2) if args.json else format_plan(plan, size)
    except (OSError, ValueError) as exc:          # json.JSONDecodeError is a ValueError
        print(f"ashl.plan: {args.profile}: {exc}", file=sys.stderr)
        return 2
    try:
        print(text)
    except BrokenPipeError:  # `... | head`: the reader is gone, nothing left to say
        sys.stdout = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
