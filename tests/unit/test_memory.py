"""What a strategy keeps beside the model, counted: README's "Memory beside the model" table
for a CPU model (where the commit as packed is the commit on the wire, and the reply lands in
the receive buffer itself)."""
import pytest
import torch

import ashl.torch as ashl
from ashl.models import build_model
from ashl.stages import StageConfig
from fake_world import FakeWorld


def _model_sized(obj, model_nbytes: int, skip: set[int]) -> dict[int, str]:
    """The storages of at least 90% of the model's size reachable from `obj`'s attributes
    (not through modules, the user's optimizer or the communicator), by where one was found."""
    found, seen, todo = {}, set(), [(obj, "")]
    while todo:
        o, path = todo.pop()
        if id(o) in seen or isinstance(o, (torch.nn.Module, torch.optim.Optimizer)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if st.nbytes() >= 0.9 * model_nbytes and st.data_ptr() not in skip:
                found.setdefault(st.data_ptr(), path)
        elif isinstance(o, dict):
            todo += [(v, f"{path}[{k!r}]") for k, v in o.items()]
        elif isinstance(o, (list, tuple)):
            todo += [(v, f"{path}[{i}]") for i, v in enumerate(o)]
        elif hasattr(o, "__dict__") and not isinstance(o, type):
            todo += [(v, f"{path}.{k}") for k, v in vars(o).items()
                     if k not in ("comm", "world", "group", "hvd")]
    return found


def _held_beside_the_model(strategy: str, **options) -> list[dict[int, str]]:
    def rank_fn(comm, hvd):
        torch.manual_seed(0)
        model = build_model("mnistnet", (1, 28, 28), 10)
        x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
        evaluate = ashl.BackgroundEvaluator(model, lambda m: 0.1) if comm.Get_rank() == 0 else None
        opt = ashl.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), model=model,
            strategy=strategy, comm=comm, evaluate=evaluate, eval_every_s=0,
            stage_config=StageConfig(max_commits=10_000), **options)
        for step in range(12):
            opt.zero_grad()
            i = (step * 8) % 64
            torch.nn.functional.cross_entropy(model(x[i:i + 8]), y[i:i + 8]).backward()
            opt.step()
        nbytes = 4 * sum(p.numel() for p in model.parameters())
        own = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}
        held = _model_sized(opt.strategy, nbytes, own)
        if evaluate is not None:
            held.update(_model_sized(evaluate, nbytes, own))
        opt.finish()
        if evaluate is not None:
            evaluate.close()
        return held

    return FakeWorld(2).run(rank_fn, timeout=120)


@pytest.mark.parametrize("strategy, options, worker, server", [
    # worker: last received, as sent, scratch, packed (= on the wire), reply; server rank,
    # besides: W, the receive buffer (one, of 2 M), its own model while W is evaluated, the
    # background evaluator's snapshot. 12 steps are still AHL: dense commits
    ("ashl", {}, 5, 5 + 4),
    # top-k commits from the start: the error feedback, and no dense commit packed (a run
    # that began in AHL keeps its dense pack buffer too: the README's 6)
    ("ashl", {"compression": ashl.Compression.topk(0.1)}, 5, 5 + 4),
    # commits block and are dense: no model as sent, no scratch, no error feedback
    ("adsp", {}, 3, 3 + 4),
])
def test_a_parameter_server_strategy_keeps_what_the_readme_says(strategy, options, worker,
                                                                 server):
    on_server, on_worker = _held_beside_the_model(strategy, **options)
    assert len(on_worker) == worker, sorted(on_worker.values())
    assert len(on_server) == server, sorted(on_server.values())
