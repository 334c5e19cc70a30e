"""The ranks' agreement on DistributedOptimizer's run-wide options (ashl/torch/agreement.py),
as pure functions; tests/mpi/test_rank_options_mpi.py runs it over mpirun."""
from hypothesis import given, strategies as st

from ashl.planner import PlannerConfig
from ashl.torch.agreement import disagreement, run_options


def test_an_option_left_out_equals_the_strategys_default():
    assert run_options("ashl", 3, None, {}) == run_options(
        "ashl", 3, None, {"overlap": True, "server_rank": 0, "transport": "zmq"})
    assert run_options("adsp", 3, None, {}) == run_options("adsp", 3, None, {"overlap": False})
    assert run_options("ashl", 3, None, {}) != run_options("ashl", 3, None, {"overlap": False})


def test_configs_compare_by_value_and_the_ranks_own_options_are_not_compared():
    a = run_options("ashl", 3, None, {"planner_config": PlannerConfig(k_ahl=4),
                                      "evaluate": lambda: 0.5, "heterogeneity": object()})
    b = run_options("ashl", 3, None, {"planner_config": PlannerConfig(k_ahl=4)})
    assert a == b
    assert a != run_options("ashl", 3, None, {"planner_config": PlannerConfig(k_ahl=2)})


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
