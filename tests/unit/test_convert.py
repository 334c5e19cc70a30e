"""ashl.convert, ashl.emulate's step stretching and the script benchmark's arithmetic, as
pure functions (their real runs: tests/mpi/test_horovod_script_mpi.py)."""
import difflib
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from ashl.bench.script import spread, summarize, time_to
from ashl.convert import ConversionError, convert
from ashl.emulate import SlowSteps
from ashl.emulation import ComputeSlowdown

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "horovod_digits.py"


def converted(tmp_path):
    out = tmp_path / "ashl_digits.py"
    out.write_text(convert(SCRIPT.read_text()))
    return out


def test_the_conversion_changes_exactly_three_lines(tmp_path):
    before = SCRIPT.read_text().splitlines()
    after = converted(tmp_path).read_text().splitlines()
    changed = [l for l in difflib.unified_diff(before, after, lineterm="", n=0)
               if l[:1] in "+-" and not l.startswith(("+++", "---"))]
    assert len(before) == len(after) and len(changed) == 6, changed
    assert "+import horovod.torch as hvd, ashl.torch as ashl" in changed
    assert any("ashl.HeterogeneousSampler(train_dataset" in l for l in changed)
    assert any("ashl.DistributedOptimizer(" in l and "sampler=train_sampler" in l for l in changed)


def test_a_script_without_the_three_lines_is_refused_naming_the_missing_one():
    with pytest.raises(ConversionError, match="hvd.DistributedOptimizer"):
        convert("import horovod.torch as hvd\ns = DistributedSampler(train_set)\n")


def test_a_test_set_sampler_is_left_alone():
    text = ("import horovod.torch as hvd\n"
            "train_sampler = DistributedSampler(train_set, num_replicas=4, rank=0)\n"
            "test_sampler = DistributedSampler(test_set, num_replicas=4, rank=0)\n"
            "opt = hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters())\n")
    out = convert(text).splitlines()
    assert out[1] == "train_sampler = ashl.HeterogeneousSampler(train_set, num_replicas=4, rank=0)"
    assert out[2] == "test_sampler = DistributedSampler(test_set, num_replicas=4, rank=0)"
    assert out[3].endswith("named_parameters=m.named_parameters(), sampler=train_sampler)")


class FakeTime:
    def __init__(self):
        self.t = 0.0

    def clock(self):
        return self.t

    def sleep(self, s):
        self.t += s


@given(st.floats(1.0, 8.0), st.lists(st.floats(0.001, 0.1), min_size=2, max_size=20))
def test_every_step_is_stretched_by_the_factor_of_the_previous_ones_compute(factor, computes):
    t = FakeTime()
    steps = SlowSteps(ComputeSlowdown(factor), clock=t.clock, sleep=t.sleep)
    for i, c in enumerate(computes):
        start = t.t
        slept = steps.before_backward()
        t.t += c                              # forward and backward
        steps.after_backward(slept)
        steps.after_step()
        assert slept == pytest.approx((factor - 1) * (computes[i - 1] if i else 0.0))
        assert steps.last_compute == pytest.approx(c) and t.t - start == pytest.approx(c + slept)


def test_a_step_time_gives_the_unchanged_script_gpu_like_steps():
    t = FakeTime()
    steps = SlowSteps(ComputeSlowdown(2.0, step_s=0.05), clock=t.clock, sleep=t.sleep)
    durations = []
    for c in (0.01, 0.03, 0.2, 0.01):
        start = t.t
        slept = steps.before_backward()
        t.t += c
        steps.after_backward(slept)
        steps.after_step()
        durations.append(t.t - start)
    # each step sleeps what the previous one's compute left of 2 x 50 ms; an overrun none
    assert durations == pytest.approx([0.01, 0.03 + 0.09, 0.2 + 0.07, 0.01])
    assert steps.slowdown.overruns == 1


def test_time_to_target_spread_and_the_ratio_per_repeat():
    assert time_to([(1.0, 0.5), (2.0, 0.9), (3.0, 0.95)], 0.9) == 2.0
    assert time_to([(1.0, 0.5)], 0.9) is None
    assert spread([3.0, None, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    runs = {"horovod": [{"final_accuracy": 0.9, "wall_s": 10.0, "curve": [(4.0, 0.85), (8.0, 0.9)]},
                        {"final_accuracy": 0.92, "wall_s": 12.0, "curve": [(5.0, 0.86), (10.0, 0.92)]}],
            "ashl": [{"final_accuracy": 0.93, "wall_s": 6.0, "curve": [(2.0, 0.87), (4.0, 0.93)]},
                     {"final_accuracy": 0.91, "wall_s": 7.0, "curve": [(3.0, 0.80), (6.0, 0.91)]}]}
    s = summarize(runs, band=0.02)
    assert s["target_accuracy"] == pytest.approx(0.89)        # median 0.91 less the band
    assert s["horovod"]["time_to_target_s"]["median"] == pytest.approx(9.0)   # 8 and 10
    assert s["ratio_time_to_target_s"]["min"] == pytest.approx(4.0 / 8.0)
    assert s["ratio_time_to_target_s"]["max"] == pytest.approx(6.0 / 10.0)
    # after the first epoch: (4 - 2) / (8 - 4) and (6 - 3) / (10 - 5)
    assert s["ratio_training_to_target_s"]["min"] == pytest.approx(0.5)
    assert s["ratio_training_to_target_s"]["max"] == pytest.approx(0.6)


def test_comments_and_a_trailing_comma_survive_the_conversion():
    text = ("import horovod.torch as hvd  # the usual\n"
            "sampler_train = DistributedSampler(ds, num_replicas=2, rank=0,)  # (shards)\n"
            "opt = hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters())  # (wrap)\n")
    out = convert(text).splitlines()
    assert out[0] == "import horovod.torch as hvd, ashl.torch as ashl  # the usual"
    assert out[1] == ("sampler_train = ashl.HeterogeneousSampler(ds, num_replicas=2, rank=0)"
                      "  # (shards)")
    assert out[2] == ("opt = ashl.DistributedOptimizer(opt, named_parameters=m.named_parameters(), "
                      "sampler=sampler_train)  # (wrap)")
    compile("\n".join(out), "converted", "exec")


def test_the_emulation_runner_names_a_mistyped_variable(monkeypatch, capsys):
    from ashl.emulate import main
    monkeypatch.setenv("ASHL_EMULATE_STEP_TIME", "fast")
    assert main([str(SCRIPT)]) == 2
    assert "ASHL_EMULATE_STEP_TIME='fast'" in capsys.readouterr().err
    monkeypatch.setenv("ASHL_EMULATE_STEP_TIME", "")
    monkeypatch.setenv("ASHL_EMULATE_COMPUTE", "1,x")
    assert main([str(SCRIPT)]) == 2
    assert "bad slowdown list" in capsys.readouterr().err
