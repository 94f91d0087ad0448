"""GPU paths (cupy): run where cupy and a CUDA GPU exist, skipped with the reason elsewhere."""

import numpy as np
import pytest

from mpidist import nn

cupy = pytest.importorskip("cupy", reason="cupy is not installed (pip install 'mpidist[gpu]')")
try:
    GPUS = cupy.cuda.runtime.getDeviceCount()
except Exception:  # no driver: the same answer as no device
    GPUS = 0
pytestmark = pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU visible to cupy")


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_a_training_step_on_the_gpu_matches_numpy(name):
    results = []
    for xp in (np, cupy):
        model = nn.build_model(name, (8, 8), 10, xp, np.float64)
        model.init_params(0)
        loss = nn.loss_for(10, xp)
        rng = np.random.default_rng(1)
        x = xp.asarray(rng.random((16,) + model.input_shape))
        y = xp.asarray(rng.integers(0, 10, 16))
        model.reseed(0)
        loss.forward(model.forward(x, training=False), y)
        model.backward(loss.backward(), input_grad=False)
        results.append(cupy.asnumpy(model.grads) if xp is cupy else model.grads.copy())
    np.testing.assert_allclose(results[1], results[0], rtol=1e-9, atol=1e-12)


@pytest.mark.mpi(min_size=2)
def test_allreduce_of_device_arrays_on_either_path(monkeypatch):
    from mpi4py import MPI

    from mpidist.runtime import comm

    world = MPI.COMM_WORLD
    monkeypatch.delenv("MPIDIST_CUDA_AWARE", raising=False)
    comm.cuda_aware.cache_clear()
    # staged always; direct only where the library says it reads device memory
    # (device pointers handed to a non-CUDA MPI would crash it)
    paths = ["0", "1"] if comm.cuda_aware() else ["0"]
    for aware in paths:
        monkeypatch.setenv("MPIDIST_CUDA_AWARE", aware)
        comm.cuda_aware.cache_clear()
        array = cupy.full(1000, world.Get_rank(), dtype=cupy.float32)
        comm.allreduce_sum(world, array)
        size = world.Get_size()
        assert float(array[0]) == size * (size - 1) / 2
    comm.cuda_aware.cache_clear()


def test_host_staging_copies_into_pinned_memory_from_cupys_pool():
    # pageable memory made a host-staged send 5 times slower than MPI between host buffers (gpu/check.sh,
    # H200)
    from mpidist.runtime import device_buffers as comm

    array = cupy.arange(1000, dtype=cupy.float32)
    host, _ = comm._staged(array)
    np.testing.assert_array_equal(host, np.arange(1000, dtype=np.float32))
    owner = host
    while isinstance(owner, np.ndarray):
        owner = owner.base
    assert isinstance(owner, memoryview)  # np.frombuffer's view of what exported the memory
    assert isinstance(owner.obj, cupy.cuda.PinnedMemoryPointer)


def test_a_staged_copy_back_is_complete_before_its_pinned_block_is_handed_out_again():
    # a copy from pinned memory is asynchronous: were the block handed out while the GPU still read it, the
    # next batch's cupy.asarray (which writes into a pooled pinned block at once) would land in the array
    from mpidist.runtime import device_buffers as comm

    size = 64 << 18  # 64 MiB of float32: a copy long enough to be caught in flight
    array = cupy.zeros(size, dtype=cupy.float32)
    host, back = comm._staged(array)
    host[...] = 1.0
    back()
    del host, back
    clobber = np.frombuffer(cupy.cuda.alloc_pinned_memory(size * 4), np.float32, size)
    clobber[...] = 7.0
    cupy.cuda.get_current_stream().synchronize()
    assert float(array.min()) == 1.0 and float(array.max()) == 1.0


@pytest.mark.mpi(min_size=2)
def test_an_ipc_link_moves_device_arrays_between_two_ranks_both_ways():
    """Ranks 0 and 1 (one GPU or two of one node): every message arrives whole, in slots made and opened once
    per message in flight, and closing frees them all."""
    from mpi4py import MPI

    from mpidist.runtime.cuda_ipc import CudaMemory
    from mpidist.runtime.ipc_link import GRANULE, IpcLink

    world = MPI.COMM_WORLD
    pair = world.Split(0 if world.Get_rank() < 2 else MPI.UNDEFINED, world.Get_rank())
    if pair == MPI.COMM_NULL:
        return
    acks, me = pair.Dup(), pair.Get_rank()
    link = IpcLink(pair, acks, 1 - me, CudaMemory())
    sizes = [3, GRANULE // 4 + 1, 16 << 18, 5]  # float32: a granule's first slot, then larger ones
    sent = [cupy.arange(size, dtype=cupy.float32) + 1000 * me for size in sizes]
    requests = [link.isend(array, tag)[0] for tag, array in enumerate(sent)]
    for array in sent:
        array.fill(-7)  # (the bytes left with the send)
    for tag in reversed(range(len(sizes))):
        got = link.recv(cupy.empty(sizes[tag], cupy.float32), tag)
        expected = np.arange(sizes[tag], dtype=np.float32) + 1000 * (1 - me)
        np.testing.assert_array_equal(cupy.asnumpy(got), expected)
    MPI.Request.Waitall(requests)
    assert len(link.slots) == len(sizes)
    link.close()
    assert link.slots == [] and link.mapped == {}
    acks.Free()
    pair.Free()


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_an_update_on_the_gpu_is_one_kernel_that_matches_the_hosts(name):
    """mpidist.nn.fused: the optimizer's step on a GPU (cupy.fuse) against numpy's blocks, three steps."""
    rng = np.random.default_rng(2)
    size = 300_001
    start = rng.standard_normal(size).astype(np.float32)
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(3)]
    results = []
    for xp in (np, cupy):
        optimizer = nn.make_optimizer(name, size, 0.01, momentum=0.9, xp=xp)
        params = xp.asarray(start.copy())
        for g in grads:
            optimizer.step(params, xp.asarray(g))
        results.append(cupy.asnumpy(params) if xp is cupy else params)
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-7)
    assert not np.allclose(results[1], start)


@pytest.mark.parametrize(
    "make, sample", [("conv2d", (3, 12, 12)), ("conv2d-strided", (3, 9, 9)), ("conv1d", (2, 20))]
)
def test_convolutions_through_cudnn_match_mpidists_own_path_on_the_gpu(monkeypatch, make, sample):
    """float32, TF32 left out: cuDNN's forward, input and weight gradients against the im2col path's."""
    pytest.importorskip("cudnn", reason="the cudnn frontend is not installed (pip install 'mpidist[gpu]')")
    from mpidist.nn import cudnn_conv

    layers = {
        "conv2d": lambda: [nn.Conv2D(8, kernel=3), nn.ReLU(), nn.Conv2D(4, kernel=3)],
        "conv2d-strided": lambda: [nn.Conv2D(8, kernel=4, stride=2), nn.ReLU(), nn.Conv2D(4, kernel=3)],
        "conv1d": lambda: [nn.Conv1D(8, kernel=3), nn.ReLU(), nn.Conv1D(4, kernel=5)],
    }[make]
    rng = np.random.default_rng(5)
    x = cupy.asarray(rng.standard_normal((16,) + sample).astype(np.float32))
    results = []
    for path in ("0", "1"):  # (mpidist's own path, then cuDNN's)
        monkeypatch.setenv("MPIDIST_CUDNN", path)
        model = nn.Sequential(layers(), sample, xp=cupy, dtype=np.float32)
        model.init_params(3)
        before = cudnn_conv.PATHS["cudnn"]
        out = model.forward(x, training=True)
        dx = model.backward(cupy.ones_like(out) * 0.1, input_grad=True)
        took = cudnn_conv.PATHS["cudnn"] - before
        assert took == (2 if path == "1" else 0), dict(cudnn_conv.PATHS)  # (why, where it was refused)
        results.append([cupy.asnumpy(array) for array in (out, dx, model.grads)])
    for own, cudnn in zip(*results):
        np.testing.assert_allclose(cudnn, own, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_draws_on_the_gpu_are_the_hosts(dtype):
    """mpidist.nn.draws: the kernel a dropout layer draws with on a GPU is the host's twin, bit for bit."""
    from mpidist.nn.draws import KeyedDraws, uniforms

    draws = KeyedDraws(cupy)
    for key in (0, 12345, 2**64 - 1):
        draws.set(key)
        got = draws.random((300, 7), dtype, cupy.empty((300, 7), dtype))
        np.testing.assert_array_equal(cupy.asnumpy(got).reshape(-1), uniforms(key, 2100, dtype))


@pytest.mark.parametrize(
    "name, keep", [("mlp", 4), ("cnn", 4), ("mlp", 1)], ids=["mlp", "cnn", "mlp-one-graph"]
)
def test_passes_replayed_as_cuda_graphs_train_as_eager_passes_do(monkeypatch, name, keep):
    """mpidist.parallel.data.graphed_passes on a GPU: the cnn's dropout included, seven steps with the
    epoch's last partial batch between full ones, an evaluation of another batch size after each, train as
    MPIDIST_GRAPHS=0's eager passes do, and the graphs were captured and replayed (none refused).  With one
    graph kept, each shape's graph pushes the other's out: captured again, its memory still its own."""
    from mpidist.parallel import LocalStrategy

    results = []
    for graphs in ("0", "1"):
        monkeypatch.setenv("MPIDIST_GRAPHS", graphs)
        model = nn.build_model(name, (8, 8), 10, cupy, np.float32)
        local = LocalStrategy(
            model,
            nn.loss_for(10, cupy),
            lambda size: nn.make_optimizer("adam", size, 0.01, xp=cupy, dtype=np.float32),
            seed=3,
        )
        local.initialize()
        if graphs == "1":
            local.passes.graphed.graphs.rule.keep = keep
        rng = np.random.default_rng(1)
        held = rng.random((13,) + model.input_shape, dtype=np.float32), rng.integers(0, 10, 13)
        losses, evaluations = [], []
        for step, size in enumerate([32, 32, 32, 20, 32, 20, 32]):
            x = cupy.asarray(rng.random((size,) + model.input_shape, dtype=np.float32))
            y = cupy.asarray(rng.integers(0, 10, size))
            losses.append(local.train_step(x, y, size / 32, step))
            evaluations.append(local.evaluate([tuple(map(cupy.asarray, held))])["loss"])
        results.append((losses, evaluations, cupy.asnumpy(model.params), local.passes.take_counts()))
        if graphs == "1":
            ran = local.passes.graphed.graphs
            expected = (
                {"eager": 2, "capture": 2, "replay": 3}
                if keep == 4
                else {"eager": 2, "capture": 3, "replay": 2}
            )
            assert ran.refused == {} and ran.ran == expected, ran.summary()
        local.free()
    (eager_losses, eager_evaluations, eager_params, eager_counts), (losses, evaluations, params, counts) = (
        results
    )
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-5)
    np.testing.assert_allclose(evaluations, eager_evaluations, rtol=1e-5)
    np.testing.assert_allclose(params, eager_params, rtol=1e-4, atol=1e-6)
    assert counts == eager_counts


@pytest.mark.parametrize(
    "layer, sample, channels_last, dtype",
    [
        (nn.MaxPool2D(2), (3, 9, 8), False, np.float32),  # (a cropped row)
        (nn.MaxPool2D(2), (3, 9, 8), False, np.float16),
        (nn.MaxPool2D(2), (3, 9, 8), False, np.float64),
        (nn.MaxPool2D(2), (5, 8, 8), True, np.float32),  # (a convolution's channels-last view)
        (nn.MaxPool2D(3), (2, 7, 9), False, np.float32),
        (nn.MaxPool2D(16), (2, 16, 17), False, np.float32),  # (256 offsets: int64 winners)
        (nn.MaxPool1D(2), (4, 11), False, np.float32),
    ],
)
def test_max_pooling_kernels_on_the_gpu_give_the_array_forms_results(
    monkeypatch, layer, sample, channels_last, dtype
):
    """mpidist.nn.pool_kernels: one kernel per pass gives the array form's maxima, winners and gradients (the
    gradients to the sign): ties to the first offset (values rounded to a few levels), a NaN the maximum
    without winning, a negative or non-finite gradient times a losing offset -0.0 or NaN."""
    from mpidist.nn import pool_kernels

    monkeypatch.setattr(pool_kernels, "FAILED", [])
    rng = np.random.default_rng(3)
    x = np.round(rng.standard_normal((6,) + sample) * 2).astype(dtype)  # (many ties)
    x.reshape(-1)[::37] = np.nan
    dy = rng.standard_normal((6,) + layer.build(sample)).astype(dtype)
    dy.reshape(-1)[::29] = np.inf
    dy.reshape(-1)[5::31] = np.nan
    results = []
    for kernels in (False, True):
        monkeypatch.setattr(pool_kernels, "usable", lambda xp, *arrays, on=kernels: on)
        model = nn.Sequential([layer], sample, xp=cupy, dtype=dtype)
        device_x = cupy.asarray(x)
        if channels_last:  # (NCHW views of NHWC memory, as the convolutions hand over)
            device_x = cupy.ascontiguousarray(device_x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
        out = model.forward(device_x, training=True)
        dx = model.backward(cupy.asarray(dy))
        results.append([cupy.asnumpy(a) for a in (out, layer.argmax, dx)])
    assert pool_kernels.FAILED == []  # (a kernel that failed would have left the array form to answer)
    for got, expected in zip(results[1], results[0]):
        np.testing.assert_array_equal(got, expected)
    # (the gradients' signs too; a maximum of -0.0 and 0.0 is either, in cupy's maximum as in the kernel)
    np.testing.assert_array_equal(np.signbit(results[1][2]), np.signbit(results[0][2]))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_nccl_sums_over_one_rank_on_the_gpu(dtype):
    """mpidist.runtime.nccl_sum with NCCL itself (one rank: the bootstrap, a sum on NCCL's stream after the
    compute stream's writes, the join, the type's code); several GPUs are needed for more."""
    from mpi4py import MPI

    from mpidist.runtime import nccl_sum

    buffer = cupy.zeros(1000, dtype)
    group, why = nccl_sum.nccl_group(MPI.COMM_SELF, buffer)
    if group is None:
        pytest.skip(f"NCCL is not there: {why}")
    try:
        buffer += cupy.arange(1000).astype(dtype)  # (queued on the compute stream just before the sum)
        group.sum(buffer[:600])
        group.sum(buffer[600:])
        group.join()
        np.testing.assert_array_equal(cupy.asnumpy(buffer), np.arange(1000).astype(dtype))
    finally:
        group.free()
