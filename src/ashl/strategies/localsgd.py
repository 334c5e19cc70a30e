"""``localsgd``: local SGD with periodic model averaging (as PyTorch's PostLocalSGD /
``torch.distributed.algorithms.model_averaging``): every rank takes the same H local steps,
then the ranks average their models with ONE in-place ``hvd.allreduce_`` (averaging.py):

    params = mean_i(params_i)        BatchNorm float buffers included

It is ``ashl-sync`` with a fixed plan (``planner.uniform_plan``: H for every rank, equal data
shares, merge weight 1/n), no profiling and no stage switch; the control slots drive the
same StageMachine on every rank, so all ranks stop on the same round.

H: ``local_steps``, default 8 = ASHL's k_AHL, the local steps ASHL gives its SLOWEST rank per
round: local SGD then spends the same compute between two averages as ASHL's bottleneck,
so the comparison isolates what ASHL adds (per-rank H_i, asynchrony, compression). The
authors' Local SGD default is H = 2 (``--H``), ASHL's k_SHL.

Where this differs from the authors' Local SGD (docs/ALGORITHM.md §8): no central server
(an allreduce instead of a PS barrier; the same average); the LR schedule is the user's.
``opt.stage`` reads "TRAIN" while training and "DONE" at the end. ``save_checkpoint`` /
``load_checkpoint`` keep the last merged model and the outer optimizer's state (diloco's
momentum), as the parameter-server strategies do.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction

from ..planner import check_local_steps, uniform_plan
from ..stages import Stage, StageConfig
from .averaging import ModelAveragingStrategy


class LocalSgdStrategy(ModelAveragingStrategy):
    name = "localsgd"
    single_stage = True

    def __init__(self, model, params, *, local_steps: int = 8, stage_config=None, **kwargs):
        check_local_steps(local_steps)
        for ignored in ("profile_steps", "planner_config", "drift_config"):
            kwargs.pop(ignored, None)   # nothing to profile or plan
        config = dataclasses.replace(StageConfig() if stage_config is None else stage_config,
                                     switch=False)
        super().__init__(model, params, stage_config=config, **kwargs)
        self.H = local_steps

    def local_steps_target(self) -> int:
        return self.H

    def merge_weight(self, stage: Stage) -> float:
        return 1.0 / self.size

    def _make_plan(self) -> None:
        """No profiling and nothing to measure: every rank builds the same fixed plan;
        training (and max_seconds) counts from the start."""
        self.adopt_plan(uniform_plan(self.size, self.H, Fraction(1, self.size),
                                     reason=self.plan_reason()))

    def plan_reason(self) -> str:
        return f"{self.name}: fixed plan, H={self.H}, model averaging"

    def _run_record(self) -> dict:
        return {"local_steps_per_round": self.H}

    def counters(self) -> dict:
        c = super().counters()
        c["local_steps_per_round"] = self.H
        return c
