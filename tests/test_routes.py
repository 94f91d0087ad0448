"""The GPU's transfer routes and graph captures: the rules, pure, checked by tables on any machine."""

import pytest

from mpidist.nn.capture import Captures, PassKey
from mpidist.runtime import routes
from mpidist.runtime.routes import Facts, RankFacts, choose, described, probe

GPU = {"device": True}


@pytest.mark.parametrize(
    ("facts", "send", "sum_"),
    [
        (Facts(), "mpi", "mpi"),  # host arrays: MPI as they are, whatever else holds
        (Facts(same_node=True, ipc=True, nccl=True, cuda_aware=True), "mpi", "mpi"),
        (Facts(**GPU), "host-staged", "host-staged"),
        (Facts(**GPU, same_node=True, ipc=True), "ipc", "ipc"),
        (Facts(**GPU, same_node=False, ipc=True), "host-staged", "host-staged"),  # (IPC within a node only)
        (Facts(**GPU, same_node=True, ipc=True, nccl=True), "ipc", "nccl"),
        (Facts(**GPU, same_node=True, ipc=True, cuda_aware=True), "ipc", "ipc"),
        (Facts(**GPU, cuda_aware=True), "cuda-aware", "cuda-aware"),
        (Facts(**GPU, nccl=True), "nccl", "nccl"),
        (Facts(**GPU, nccl=True, cuda_aware=True), "cuda-aware", "nccl"),
    ],
)
def test_each_transfer_takes_the_fastest_route_its_facts_allow(facts, send, sum_):
    assert choose("send", facts)[0] == send and choose("sum", facts)[0] == sum_


def test_a_route_says_why_and_staging_names_everything_missing():
    route, why = choose("send", Facts(**GPU, same_node=True))
    assert route == "host-staged"
    assert why == "no CUDA IPC between these ranks; MPI is not CUDA-aware; no NCCL"
    assert choose("sum", Facts(**GPU))[1] == "ranks on several nodes; MPI is not CUDA-aware; no NCCL"
    assert described(Facts()) == "no GPU: host arrays go through MPI as they are"
    assert described(Facts(**GPU, nccl=True)).startswith("send: nccl (NCCL's send and receive")
    with pytest.raises(ValueError, match="a send or a sum, not 'gather'"):
        choose("gather", Facts())


def test_without_cupy_or_a_gpu_the_probe_finds_host_arrays():
    facts = probe(same_node=True, cuda_aware=False)
    try:
        import cupy

        gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        gpus = 0
    assert facts.device == (gpus > 0) and facts.same_node
    if not gpus:
        assert choose("send", facts)[0] == "mpi"


def key(shape=(64, 784), what="train", buffers=(1, 2)):
    return PassKey(what, shape, "float32", 0, buffers)


def test_a_pass_runs_eagerly_once_is_captured_the_next_time_and_replayed_after():
    captures = Captures()
    assert [captures.decide(key()) for _ in range(4)] == ["eager", "capture", "replay", "replay"]


def test_a_new_shape_or_new_buffers_is_a_graph_of_its_own_and_the_old_ones_stay():
    captures = Captures()
    full, last, evaluation = key(), key((17, 784)), key((1000, 784), "eval")
    moved = key(buffers=(3, 4))  # (the gradients bound into an exchange's buffer)
    order = [full, full, last, full, last, evaluation, evaluation, last, full, moved, moved, full]
    assert [captures.decide(k) for k in order] == [
        "eager", "capture", "eager", "replay", "capture", "eager", "capture", "replay", "replay",
        "eager", "capture", "replay",
    ]  # fmt: skip


def test_the_graph_unused_longest_goes_first_and_is_captured_again_when_it_returns():
    captures = Captures(keep=2)
    a, b, c = key((1, 4)), key((2, 4)), key((3, 4))
    for k in (a, a, b, b, a):
        captures.decide(k)
    assert captures.held == [b, a]
    assert captures.decide(c) == "eager" and captures.decide(c) == "capture"
    assert captures.held == [a, c]  # (b went: unused longest)
    assert captures.decide(b) == "capture"  # (its arrays are made: no eager pass again)


def test_a_failed_capture_runs_eagerly_for_good_and_forget_starts_every_key_again():
    captures = Captures()
    captures.decide(key())
    assert captures.decide(key()) == "capture"
    captures.failed(key())
    assert [captures.decide(key()) for _ in range(3)] == ["eager"] * 3
    other = key((8, 784))
    captures.decide(other), captures.decide(other)
    captures.forget()
    assert [captures.decide(other) for _ in range(3)] == ["eager", "capture", "replay"]


@pytest.mark.parametrize(
    "one, other, route",
    [
        (RankFacts(0, True, True), RankFacts(0, True, True), "ipc"),
        (RankFacts(0, True, True), RankFacts(1, True, True), "host-staged"),  # (two nodes)
        (RankFacts(0, True, True, True), RankFacts(1, True, True, True), "cuda-aware"),
        (RankFacts(0, True, True, True), RankFacts(1, True, True, False), "host-staged"),
        (RankFacts(0, True, False), RankFacts(0, True, True), "host-staged"),  # (one end without IPC)
        (RankFacts(0, False), RankFacts(0, True, True), "mpi"),  # (one end's arrays on the host)
    ],
)
def test_a_send_between_two_ranks_goes_by_what_both_ends_allow(one, other, route):
    assert choose("send", Facts.between(one, other))[0] == route
    assert choose("send", Facts.between(other, one))[0] == route


def test_ipc_is_a_fact_of_a_device_rank_only_and_can_be_turned_off(monkeypatch):
    assert RankFacts.of(3, device=True, ipc=True) == RankFacts(3, True, True, False)
    assert RankFacts.of(3, device=False, ipc=True, cuda_aware=True) == RankFacts(3, False, False, False)
    monkeypatch.setenv("MPIDIST_IPC", "0")
    assert not routes._ipc_possible()
