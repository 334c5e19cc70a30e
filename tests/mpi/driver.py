"""Multi-rank driver for the coordinator tests (run under mpirun; see _util.run_driver).

Each rank does emulated steps (a sleep of --base-step, stretched by its compute slowdown
factor), profiles them with the real profiler, measures its link to rank 0 with a real
payload, and then runs commit rounds through the real ServerClient and a ParameterServer
thread on rank 0, whose coordinator answers every commit. The training loss is synthetic (a decaying or constant curve).
Every rank writes OUT/rank<r>.json with what it saw.
"""

import argparse
import json
import math
import os
import sys
import time

import torch

from ashl.client import Commit, ServerClient
from ashl.compression import Compression
from ashl.coordinator import DriftConfig, MPICoordinator
from ashl.emulation import ComputeSlowdown, factors_from_string
from ashl.planner import PlannerConfig, RankProfile
from ashl.profiler import StepTimer
from ashl.server import ParameterServer, ServerThread
from ashl.transport import MPIRankEnd, MPIServerEnd
from ashl.stages import RunningLoss, Stage, StageConfig


class PacedWork:
    """The emulated "real work": a sleep whose average length is exactly `seconds`.

    On a loaded machine a sleep wakes late by a random few ms, which would differ per rank
    and then be multiplied by the slowdown; paying each overshoot back on the next step
    keeps every rank's mean real step at `seconds`.
    """

    def __init__(self, seconds):
        self.seconds, self.carry = seconds, 0.0

    def __call__(self):
        want = self.seconds + self.carry
        t0 = time.perf_counter()
        if want > 0:
            time.sleep(want)
        self.carry = max(want - (time.perf_counter() - t0), -self.seconds)


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--factors", default="1,2,4", help="compute slowdown per rank")
    p.add_argument("--base-step", type=float, default=0.005)
    p.add_argument("--profile-steps", type=int, default=30)
    p.add_argument("--payload-bytes", type=int, default=1 << 16)
    p.add_argument("--change", default="", help="RANK:FACTOR:COMMIT, new factor after that many commits")
    p.add_argument("--loss-start", type=float, default=2.0)
    p.add_argument("--loss-halflife", type=float, default=0.0, help="seconds; 0 = constant loss")
    p.add_argument("--switch-loss", type=float, default=0.3)
    p.add_argument("--ahl-max-commits", type=int)
    p.add_argument("--max-commits", type=int)
    p.add_argument("--max-seconds", type=float)
    p.add_argument("--wall-limit", type=float, default=30.0, help="safety stop (seconds)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    stage_config = StageConfig(switch_loss=args.switch_loss, ahl_max_commits=args.ahl_max_commits,
                               max_commits=args.max_commits, max_seconds=args.max_seconds)
    # The fixed k: these runs test drift re-planning and stage switches, not the choice of k
    # (with k = 1 the zero-delta commits of this driver make the link drift dominate).
    mc = MPICoordinator(planner_config=PlannerConfig(comm_budget=None), stage_config=stage_config,
                        drift_config=DriftConfig())
    rank, size = mc.rank, mc.size
    factors = factors_from_string(args.factors)
    if len(factors) != size:
        raise SystemExit(f"--factors has {len(factors)} entries for {size} ranks")
    change = None
    if args.change:
        r, f, c = args.change.split(":")
        change = (int(r), float(f), int(c))
    slowdown = ComputeSlowdown(factors[rank])
    work = PacedWork(args.base_step)

    def step():
        with slowdown:
            work()

    # ---- profiling: real (emulated) steps and a round trip for the real payload
    timer = StepTimer()
    for _ in range(args.profile_steps):
        timer.time(step)
    push, pull = mc.measure_link(args.payload_bytes)
    profile = RankProfile(compute_s=timer.summary().mean, push_s=push.mean, pull_s=pull.mean,
                          name=f"rank{rank}")
    plan = mc.establish_plan(profile)
    first_plan = plan.to_json()

    # ---- training rounds: every commit through the real client and parameter server (a
    # model of payload_bytes, zero deltas: only the coordinator's decisions matter here)
    numel = max(1, args.payload_bytes // 4)
    wire = mc.comm.Dup()
    server = None
    if rank == mc.root:
        server = ServerThread(ParameterServer(torch.zeros(numel), size, mc.coordinator,
                                              rank=rank), MPIServerEnd(wire, numel),
                              lock=mc.lock).start()
    client = ServerClient(MPIRankEnd(wire, mc.root, numel, server_error=lambda: (
        None if server is None else server.error)), rank, numel)
    zeros = [torch.zeros(numel)]
    send_buf = torch.empty(4 * numel, dtype=torch.uint8)
    t_train = time.monotonic()
    running = RunningLoss()
    stage, version = Stage.AHL, 0
    commits, plans_seen, stages_seen = [], [{"commit": 0, "version": plan.version,
                                             "ahl": list(plan.ahl.local_steps),
                                             "shl": list(plan.shl.local_steps)}], [
        {"commit": 0, "stage": stage.value}]
    while True:
        if change and change[0] == rank and len(commits) == change[2]:
            slowdown.factor = change[1]
        h = plan.local_steps(rank, stage)
        rt = StepTimer()
        for _ in range(h):
            rt.time(step)
            t = time.monotonic() - t_train
            loss = args.loss_start * (0.5 ** (t / args.loss_halflife) if args.loss_halflife > 0 else 1.0)
            running.add(loss)
        if server is not None and time.monotonic() - t_train > args.wall_limit:
            server.request_stop("driver wall limit")
        step_s = math.fsum(rt.samples) / len(rt.samples)
        reply = client.commit(Compression.none.pack(zeros, zeros, None, None, send_buf), Commit(
            stage=stage, number=len(commits), base_version=version, plan_version=plan.version,
            epoch=0, local_steps=h, step_s=step_s, loss=running.commit()))
        version = reply.version
        commits.append({"commit": len(commits) + 1, "t": time.monotonic() - t_train, "stage": stage.value,
                        "h": h, "step_s": step_s, "factor": slowdown.factor,
                        "plan_version": plan.version, "loss": running.value})
        if reply.plan is not None:
            plan = reply.plan
            plans_seen.append({"commit": len(commits), "version": plan.version,
                               "ahl": list(plan.ahl.local_steps), "shl": list(plan.shl.local_steps)})
        new_stage = Stage.DONE if reply.stop else reply.stage
        if new_stage is not stage:
            stage = new_stage
            stages_seen.append({"commit": len(commits), "stage": stage.value})
        if reply.stop:
            break
    if server is not None:
        server.join()
    root_machine = mc.coordinator.machine if rank == mc.root else None
    stop_reason = mc.comm.bcast(root_machine.stop_reason if root_machine else None, root=mc.root)
    events = [e.to_dict() for e in mc.coordinator.events] if root_machine else []
    transitions = ([t.__dict__ | {"from_stage": t.from_stage.value, "to_stage": t.to_stage.value}
                    for t in root_machine.transitions] if root_machine else [])
    wire.Free()
    mc.close()
    result = {"rank": rank, "size": size, "factor": factors[rank], "change": change,
              "profile": profile.to_dict(), "first_plan": first_plan, "final_plan": plan.to_json(),
              "plans_seen": plans_seen, "stages_seen": stages_seen, "commits": commits,
              "stop_reason": stop_reason, "events": events, "transitions": transitions}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
