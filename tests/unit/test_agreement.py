"""The ranks' agreement on DistributedOptimizer's run-wide options (ashl/torch/agreement.py),
as pure functions; tests/mpi/test_rank_options_mpi.py runs it over mpirun."""
import torch
from hypothesis import given, strategies as st

from ashl.planner import PlannerConfig
from ashl.torch.agreement import disagreement, run_options


def test_an_option_left_out_equals_the_strategys_default():
    assert run_options("ashl", 3, None, {}) == run_options(
        "ashl", 3, None, {"overlap": True, "server_rank": 0, "transport": "zmq"})
    assert run_options("adsp", 3, None, {}) == run_options("adsp", 3, None, {"overlap": False})
    assert run_options("ashl", 3, None, {}) != run_options("ashl", 3, None, {"overlap": False})


def test_options_compare_as_the_strategy_reads_them():
    """Horovod's compressors as ashl's, specs parsed, an option the strategy does not take
    (dropped or refused on its own rank) and one it does not read left out."""
    import horovod.torch as hvd
    from ashl.compression import Compression
    assert run_options("ashl", 3, hvd.Compression.none, {"outer_optimizer": "none"}) \
        == run_options("ashl", 3, None, {})
    assert run_options("ashl", 3, hvd.Compression.fp16, {}) \
        == run_options("ashl", 3, Compression.fp16, {})
    assert run_options("diloco", 3, None, {"outer_optimizer": "nesterov(0.7,  0.9)"}) \
        == run_options("diloco", 3, None, {})
    assert run_options("ashl", 3, None, {"staleness_fn": "polynomial(0.5)",
                                         "planner_config": PlannerConfig()}) \
        == run_options("ashl", 3, None, {})
    assert run_options("localsgd", 3, None, {"overlap": False, "fault_tolerant": False}) \
        == run_options("localsgd", 7, None, {})          # (no bound, no overlap, no faults)
    assert run_options("ashl", 3, None, {"fault_timeout_s": 9.0}) \
        == run_options("ashl", 3, None, {})              # read only by a fault-tolerant run
    assert run_options("ashl", 3, Compression.topk(0.1), {}) \
        != run_options("ashl", 3, Compression.topk(0.1, dense_when_cheaper=False), {})
    assert run_options("ashl", 3, Compression.topk(0.1), {}) \
        != run_options("ashl", 3, Compression.topk(0.1000001), {})


def test_a_spec_one_rank_cannot_parse_is_compared_as_written():
    """(that rank refuses it itself; its text must not fail here first)"""
    assert "bogus" in run_options("ashl", 3, None, {"outer_optimizer": "bogus(1)"})[
        "outer_optimizer"]


def test_configs_compare_by_value_and_the_ranks_own_options_are_not_compared():
    a = run_options("ashl", 3, None, {"planner_config": PlannerConfig(k_ahl=4),
                                      "evaluate": lambda: 0.5, "heterogeneity": object()})
    b = run_options("ashl", 3, None, {"planner_config": PlannerConfig(k_ahl=4)})
    assert a == b
    assert a != run_options("ashl", 3, None, {"planner_config": PlannerConfig(k_ahl=2)})


def test_horovods_keywords_are_compared_under_bsp_alone():
    """bsp hands them to Horovod (another on one rank posts other allreduces); the other
    strategies refuse them on each rank, or honour them rank by rank."""
    import horovod.torch as hvd
    keywords = dict(backward_passes_per_step=1, op=None, gradient_predivide_factor=1.0,
                    num_groups=0, groups=None, sparse_as_dense=False, process_set=None)
    base = run_options("bsp", 3, None, {}, keywords)
    assert base["backward_passes_per_step"] == "1" and base["op"] == "'Average'"
    assert run_options("bsp", 3, None, {}, dict(keywords, op=hvd.Average)) == base
    for change in ({"backward_passes_per_step": 2}, {"op": hvd.Sum}, {"sparse_as_dense": True},
                   {"gradient_predivide_factor": 2.0}, {"num_groups": 2}):
        assert run_options("bsp", 3, None, {}, dict(keywords, **change)) != base, change
        assert run_options("ashl", 3, None, {}, dict(keywords, **change)) \
            == run_options("ashl", 3, None, {}, keywords)
    assert run_options("bsp", 3, None, {}, dict(keywords, num_groups=2)) \
        == run_options("bsp", 3, None, {}, dict(keywords, groups=2))


def test_horovods_groups_compare_as_the_same_parameters_in_the_same_order():
    """Horovod posts a group as one allreduce named after its first tensor: the same sizes
    with other members, or another order, would leave each rank waiting for the other's."""
    def groups_on_a_rank(*positions):
        params = [torch.zeros(1) for _ in range(3)]      # each rank's own tensors
        opt = torch.optim.SGD(params, lr=0.1)
        groups = [[params[i] for i in group] for group in positions]
        return run_options("bsp", 3, None, {}, {"groups": groups}, opt)["groups"]
    assert groups_on_a_rank((0, 1), (2,)) == groups_on_a_rank((0, 1), (2,))
    assert groups_on_a_rank((0, 1), (2,)) != groups_on_a_rank((1, 2), (0,))
    assert groups_on_a_rank((0, 1)) != groups_on_a_rank((1, 0))


def test_a_value_that_fails_to_parse_leaves_its_refusal_to_travel():
    """(run_options must not raise before the ranks compare: the check that refuses the value
    raises inside the agreement, and its message reaches every rank)"""
    text = run_options("bsp", 3, None, {}, {"gradient_predivide_factor": None,
                                            "sparse_as_dense": torch.ones(2)})
    assert text["gradient_predivide_factor"] == "None"


def test_a_rank_that_refused_before_its_options_were_read_is_named_alone():
    same = run_options("ashl", 3, None, {})
    message = disagreement([(None, same), ("TypeError: bad", {})])
    assert message == "DistributedOptimizer's options were refused on rank 1: TypeError: bad"


def test_the_ranks_agree():
    same = run_options("ashl", 3, None, {})
    assert disagreement([(None, same)] * 4) is None


def test_a_difference_names_the_option_and_the_ranks_of_each_value():
    views = [(None, run_options("ashl", s, None, {})) for s in (3, 5, 3, 5)]
    message = disagreement(views)
    assert "staleness is 3 on ranks 0, 2, 5 on ranks 1, 3" in message
    assert "every rank must pass the same" in message


def test_another_strategy_is_named_alone():
    """The other options' defaults differ with the strategy: naming them would be noise."""
    message = disagreement([(None, run_options("ashl", 3, None, {})),
                            (None, run_options("localsgd", 3, None, {}))])
    assert "strategy is 'ashl' on rank 0, 'localsgd' on rank 1" in message
    assert "overlap" not in message and "server_rank" not in message


def test_a_refusal_on_one_rank_reaches_the_others():
    same = run_options("localsgd", 3, None, {})
    message = disagreement([(None, same), ("ValueError: overlap=True: no", same)])
    assert message.startswith("DistributedOptimizer's options were refused on rank 1: "
                              "ValueError: overlap=True: no")


_view = st.tuples(st.sampled_from([None, "ValueError: refused"]),
                  st.fixed_dictionaries({"strategy": st.sampled_from(["'ashl'", "'ssp'"]),
                                         "staleness": st.sampled_from(["3", "4"])}))


@given(st.lists(_view, min_size=1, max_size=6))
def test_silence_only_when_no_rank_refused_and_all_options_are_equal(views):
    agreed = all(error is None for error, _ in views) and all(o == views[0][1] for _, o in views)
    assert (disagreement(views) is None) == agreed
