"""Overlapped commits without MPI: the update w <- W + (w - w_sent), anchor <- W, exactly;
nothing a rank steps is lost or merged twice, with and without top-k's residual; the
server's damping of an overlapped commit; the client's commit in slices."""
import threading
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ashl import protocol
from ashl.client import Commit, ServerClient
from ashl.compression import Compression, Residual
from ashl.emulation import Heterogeneity, Link
from ashl.overlap import add_progress, rebase, take_progress
from ashl.protocol import DType, Flag, Header, Kind
from ashl.stages import Stage
from ashl.transport import RankEnd

from test_server import N as SERVER_N, dense, server

N = 12


def ints(values):
    """Small integers in fp32: every sum below is exact, so equality is the test."""
    return torch.tensor(values, dtype=torch.float32)


def test_rebase_is_the_global_model_plus_the_progress_since_the_send():
    params = [ints([5, 6, 7]), ints([[1, 2], [3, 4]])]
    anchors = [torch.zeros(3), torch.zeros(2, 2)]
    sent = [ints([4, 4, 4]), ints([[1, 1], [1, 1]])]        # w when the commit left
    model = ints([10, 20, 30, 40, 50, 60, 70])               # W, flat
    rebase(params, anchors, sent, model)
    assert torch.equal(anchors[0], ints([10, 20, 30]))
    assert torch.equal(anchors[1], ints([[40, 50], [60, 70]]))
    assert torch.equal(params[0], ints([11, 22, 33]))        # W + (w - w_sent)
    assert torch.equal(params[1], ints([[40, 51], [62, 73]]))
    assert torch.equal(sent[0], ints([1, 2, 3]))             # left holding the progress


def test_without_progress_the_rebase_is_the_plain_reply():
    params, anchors = [ints([3, 1])], [ints([0, 0])]
    sent = [params[0].clone()]
    rebase(params, anchors, sent, ints([8, 9]))
    assert torch.equal(params[0], ints([8, 9])) and torch.equal(anchors[0], ints([8, 9]))


def test_the_halves_leave_room_to_evaluate_the_global_model():
    params, sent = [ints([7, 7])], [ints([5, 6])]
    take_progress(params, sent)
    assert torch.equal(sent[0], ints([2, 1]))
    params[0].copy_(ints([1, 1]))                            # W loaded, evaluated here
    add_progress(params, sent)
    assert torch.equal(params[0], ints([3, 2]))


class Rank:
    """One simulated rank: integer steps, commits packed by a real compressor, the reply
    taken `delay` steps after the send (0: at once, as without overlap)."""

    def __init__(self, w0, compressor):
        self.params = [w0.clone()]
        self.anchors = [w0.clone()]
        self.residual = Residual(self.params) if compressor is not Compression.none else None
        self.compressor = compressor
        self.scratch = torch.empty(N)
        self.buf = torch.empty(compressor.max_nbytes(N), dtype=torch.uint8)
        self.sent = [w0.clone()]
        self.flight = None          # (reply model, the step it lands at)
        self.progress = torch.zeros(N)
        self.merged = 0

    def step(self, increment):
        self.params[0] += increment
        self.progress += increment

    def commit(self, global_model, now, delay):
        payload = self.compressor.pack(self.params, self.anchors, self.residual, self.scratch,
                                       self.buf)
        assert payload.merge_into(global_model, 1.0)
        self.merged += 1
        self.sent[0].copy_(self.params[0])
        self.flight = (global_model.clone(), now + delay)

    def land(self):
        model, _ = self.flight
        self.flight = None
        rebase(self.params, self.anchors, self.sent, model)

    def unsent(self):
        """What this rank holds that the server has not merged."""
        rest = self.params[0] - self.anchors[0]
        return rest if self.residual is None else rest + self.residual.flat


def simulate(ranks, schedule, compressor):
    """schedule: per tick, per rank (increment, commit now?, reply delay in ticks). Every
    rank's last round goes out blocking at the end, as finish() sends it."""
    w0 = ints(list(range(N)))
    global_model = w0.clone()
    sim = [Rank(w0, compressor) for _ in range(ranks)]
    for t, tick in enumerate(schedule):
        for r, (increment, commit, delay) in zip(sim, tick):
            r.step(ints(increment))
            if r.flight is not None and t >= r.flight[1]:
                r.land()
            if commit:
                if r.flight is not None:
                    r.land()                     # one in flight: the round's end waits
                r.commit(global_model, t, delay)
    for r in sim:
        if r.flight is not None:
            r.land()
        r.commit(global_model, len(schedule), 0)
        r.land()
    return w0, global_model, sim


tick = st.tuples(st.lists(st.integers(-3, 3), min_size=N, max_size=N), st.booleans(),
                 st.integers(0, 4))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(tick, min_size=1, max_size=1), min_size=1, max_size=30))
def test_one_rank_weight_one_the_server_merged_all_its_progress(schedule):
    w0, global_model, (rank,) = simulate(1, schedule, Compression.none)
    # the sum of every merged delta is the rank's total local progress, exactly
    assert torch.equal(global_model - w0, rank.progress)
    assert torch.equal(rank.params[0], global_model)       # and it ends on the global model


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 3).flatmap(lambda n: st.lists(st.lists(tick, min_size=n, max_size=n),
                                                     min_size=1, max_size=25)))
def test_several_ranks_nothing_lost_nothing_twice(schedule):
    w0, global_model, ranks = simulate(len(schedule[0]), schedule, Compression.none)
    assert torch.equal(global_model - w0, sum(r.progress for r in ranks))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(tick, min_size=2, max_size=2), min_size=1, max_size=25))
def test_top_k_residuals_keep_what_was_not_sent(schedule):
    # the last blocking commit is top-k too: what it left behind stays in the residuals
    w0, global_model, ranks = simulate(2, schedule, Compression.topk(0.25))
    assert torch.equal(global_model - w0 + sum(r.unsent() for r in ranks),
                       sum(r.progress for r in ranks))


def test_server_expects_an_overlapped_commits_flight():
    s = server(n_ranks=3, staleness="polynomial(1)")
    s.handle(*dense(0, torch.zeros(SERVER_N), base=0))             # rank 0's reply: version 1
    assert s.replied_version[0] == 1
    s.version = 5                                          # four merges of the others since
    # rank 0's next commit began its steps on version 0, before that reply (overlap):
    header, _ = dense(0, torch.zeros(SERVER_N), base=0)
    assert s.in_flight(header) == 1
    assert s.excess(s.version - 0, s.in_flight(header)) == 5 - 1 - 2
    # a commit made after its reply (no overlap) has nothing in flight
    assert s.in_flight(dense(0, torch.zeros(SERVER_N), base=1)[0]) == 0


@given(st.integers(0, 50), st.integers(0, 50))
def test_the_in_flight_allowance_only_ever_lowers_the_excess(staleness, in_flight):
    s = server(n_ranks=4)
    assert 0 <= s.excess(staleness, in_flight) <= s.excess(staleness)


class QueueEnd(RankEnd):
    """A RankEnd whose server answers each commit at once with a fixed model."""

    def __init__(self, numel, version=7):
        self.numel, self.version, self.queue, self.sent = numel, version, [], []
        self.sent_at, self.threads = [], []      # when, and from which thread, each left
        self.error = None                        # what send raises, if set

    def send(self, header, payload=None, cancelled=None):
        if self.error is not None:
            raise self.error
        self.sent.append(header)
        self.sent_at.append(time.monotonic())
        self.threads.append(threading.current_thread())
        body = torch.arange(self.numel, dtype=torch.float32)
        self.queue.append((Header(kind=Kind.REPLY, rank=0, stage=Stage.AHL,
                                  base_version=self.version, dtype=DType.FLOAT32,
                                  numel=self.numel, flags=Flag.ACCEPTED,
                                  sent_at=time.monotonic()), body))
        return True

    def poll(self, timeout_s=0.0):
        return bool(self.queue)

    def recv(self, buffer):
        header, body = self.queue.pop(0)
        raw = protocol.encode(header)
        buffer.array[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).numpy()
        buffer.array[len(raw):len(raw) + body.numel() * 4] = body.view(torch.uint8).numpy()
        return protocol.received(buffer, len(raw) + body.numel() * 4, 0, world_size=2,
                                 model_numel=self.numel)


def commit_args():
    return Commit(stage=Stage.AHL, number=0, base_version=0, plan_version=1, epoch=0,
                  local_steps=1)


def test_client_commit_in_slices_waits_for_the_emulated_departure_and_arrival():
    end = QueueEnd(N)
    link = Link(latency_s=0.05, bytes_per_s=1e12)
    client = ServerClient(end, 1, N, heterogeneity=Heterogeneity(link=link))
    payload = Compression.none.compress(torch.zeros(N))
    client.begin(payload, commit_args())
    assert client.reply(wait=False) is None and not end.sent   # not departed yet
    with pytest.raises(RuntimeError):
        client.begin(payload, commit_args())                    # one in flight at most
    reply = client.reply(wait=True)
    assert len(end.sent) == 1 and reply.version == 7 and reply.accepted
    assert torch.equal(reply.model, torch.arange(N, dtype=torch.float32))
    assert client.inflight is None and client.last_link_s >= 2 * 0.05


def linked_client(latency_s: float, end=None):
    end = end or QueueEnd(N)
    return end, ServerClient(end, 1, N, heterogeneity=Heterogeneity(
        link=Link(latency_s=latency_s, bytes_per_s=1e12)))


def begin(client):
    client.begin(Compression.none.compress(torch.zeros(N)), commit_args())


def test_an_overlapped_commit_leaves_at_its_departure_time_without_a_poll():
    """Over an emulated link the upload runs beside the rank's steps, as a real link's: the
    commit leaves at its departure time even though the rank does not poll until later
    (before, it left at the first poll after it, up to a step late), and the reply's link
    time is the upload and the download, not the poll's quantum."""
    end, client = linked_client(0.1)
    began = time.monotonic()
    begin(client)
    assert client.reply(wait=False) is None and not end.sent       # not departed yet
    time.sleep(0.6)                                                 # a long local step
    assert len(end.sent) == 1 and 0.1 <= end.sent_at[0] - began < 0.5    # at 0.1 s, alone
    assert end.threads[0] is not threading.current_thread()
    reply = client.reply(wait=False)
    assert reply is not None and reply.accepted and client.inflight is None
    assert 0.2 <= client.last_link_s < 0.5                          # up, down; not the 0.6 s


def test_without_a_link_an_overlapped_commit_leaves_at_once():
    """Over ZeroMQ (a send that returns at once) and no emulated link: sent by begin, not
    after the rank's next step."""
    end = QueueEnd(N)
    client = ServerClient(end, 1, N)
    begin(client)
    assert len(end.sent) == 1 and end.threads == [threading.current_thread()]
    assert client.reply(wait=False).accepted


def test_an_uploaders_failure_is_raised_by_the_reply():
    end, client = linked_client(0.02)
    end.error = ConnectionError("the server is gone")
    begin(client)
    with pytest.raises(ConnectionError, match="the server is gone"):
        client.reply(wait=True)


def test_close_cancels_a_commit_that_has_not_left():
    end, client = linked_client(1.0)
    begin(client)
    uploader = client.inflight.uploader
    client.close()
    assert not uploader.is_alive() and client.inflight is None      # at once, not in 1 s
    time.sleep(0.05)
    assert not end.sent
    begin(client)                                                   # nothing in flight now


def test_a_blocking_commit_leaves_from_the_callers_thread():
    end, client = linked_client(0.02)
    reply = client.commit(Compression.none.compress(torch.zeros(N)), commit_args())
    assert reply.accepted and client.inflight is None
    assert end.threads == [threading.current_thread()]      # no uploader: nothing to overlap


def test_over_a_transport_whose_send_blocks_an_overlapped_commit_is_sent_from_a_thread():
    """MPI's send waits for the transfer: the upload overlaps the steps only from a thread."""
    end = QueueEnd(N)
    end.send_blocks = True
    client = ServerClient(end, 1, N)
    begin(client)
    assert client.reply(wait=True).accepted
    assert len(end.threads) == 1 and end.threads[0] is not threading.current_thread()


class LandingEnd(QueueEnd):
    """A real link's end (no emulated link) whose reply lands `delay_s` after the commit
    leaves, and whose poll waits idle for it, as ZeroMQ's does."""

    poll_waits_idle = True

    def __init__(self, numel, delay_s):
        super().__init__(numel)
        self.delay_s, self.landed, self.polled_from = delay_s, threading.Event(), set()

    def send(self, header, payload=None, cancelled=None):
        super().send(header, payload)
        reply, self.queue = self.queue.pop(), []
        threading.Timer(self.delay_s, self._land, args=(reply,)).start()
        return True

    def _land(self, reply):
        self.queue.append(reply)
        self.landed.set()

    def poll(self, timeout_s=0.0):
        self.polled_from.add(threading.current_thread())
        self.landed.wait(timeout_s)
        return bool(self.queue)


def test_a_real_links_reply_is_timed_when_it_lands_not_when_the_rank_looks():
    """The rank looks for the reply only between its steps: the link time the drift
    detector is told ends where the reply landed (stamped by the commit's thread), not a
    long step later (before, 1 s here, and the server re-planned on links that looked
    slower than they were)."""
    end = LandingEnd(N, delay_s=0.1)
    client = ServerClient(end, 1, N)
    begin(client)
    time.sleep(1.0)                                                 # a long local step
    reply = client.reply(wait=False)
    assert reply is not None and reply.accepted and client.inflight is None
    assert 0.1 <= client.last_link_s < 0.6
    assert end.threads[0] is not threading.current_thread() and end.threads[0] in end.polled_from


def test_close_ends_a_reply_watcher_at_once():
    end = LandingEnd(N, delay_s=5.0)
    client = ServerClient(end, 1, N)
    begin(client)
    watcher = client.inflight.uploader
    started = time.monotonic()
    client.close()
    assert not watcher.is_alive() and time.monotonic() - started < 2.0     # not the 5 s
    begin(client)                                                   # nothing in flight now


def test_over_a_transport_that_cannot_wait_idle_no_thread_watches():
    """An MPI end polls by sleeping in Python: a watcher would wake the rank's process every
    0.2 ms for the whole flight, so the reply is timed where the rank sees it."""
    end = LandingEnd(N, delay_s=0.05)
    end.poll_waits_idle = False
    client = ServerClient(end, 1, N)
    begin(client)
    assert client.inflight.uploader is None and end.threads == [threading.current_thread()]
    time.sleep(0.3)
    assert client.reply(wait=False) is not None and client.last_link_s >= 0.3


def test_client_without_a_link_takes_the_reply_at_the_first_poll():
    client = ServerClient(QueueEnd(N), 1, N)
    client.begin(Compression.none.compress(torch.zeros(N)), commit_args())
    reply = client.reply(wait=False)
    assert reply is not None and reply.version == 7 and client.inflight is None


@pytest.mark.parametrize("strategy", ["bsp", "ashl-sync", "localsgd", "diloco"])
def test_overlap_is_refused_where_nothing_is_in_flight(strategy):
    from ashl.torch.optimizer import _strategy_options
    with pytest.raises(ValueError, match="overlap=True"):
        _strategy_options(strategy, 3, {"overlap": True})
    # off passes, and the strategy, which has no such option, never sees it
    assert "overlap" not in _strategy_options(strategy, 3, {"overlap": False})


@pytest.mark.parametrize("strategy", ["ashl", "ssp", "asp", "adsp", "async-localsgd"])
def test_overlap_reaches_a_parameter_server_strategy(strategy):
    from ashl.torch.optimizer import _strategy_options
    assert _strategy_options(strategy, 3, {"overlap": True})["overlap"] is True


def test_the_strategy_refuses_an_overlap_that_is_not_a_bool():
    from ashl.strategies.parameter_server import check_overlap
    with pytest.raises(ValueError, match="overlap must be True, False or None"):
        check_overlap("yes", False)


def test_overlap_none_is_the_strategys_default():
    from ashl.strategies import PARAMETER_SERVER, strategy_class
    from ashl.strategies.parameter_server import check_overlap
    assert check_overlap(None, True) is True and check_overlap(None, False) is False
    assert check_overlap(False, True) is False and check_overlap(True, False) is True
    # on where the benchmark shows it wins (docs/BENCHMARKS.md "Overlapped commits")
    defaults = {s: strategy_class(s).overlaps_by_default for s in PARAMETER_SERVER}
    assert defaults == {"ashl": True, "ssp": False, "asp": False, "adsp": False,
                        "async-localsgd": False}
