"""The GPU check's benchmark: mpidist against torch on the same GPU, and a pipeline's activation send.

``python gpu/bench.py models --out F``: one training step (forward, loss,
backward, SGD with momentum) of the MLP 784-512-512-10 (``mlp-wide``) and the
``cnn`` on MNIST-shaped float32 batches of 256 to 4096, mpidist on cupy against
the same layers in torch (eager, TF32 off), alternating step by step, medians;
then in bf16 (``--precision bf16``: float32 master weights) against torch under
``torch.autocast`` in bfloat16, and mpidist's bf16 step against its float32 one.
In float32 mpidist's step also runs with its passes eager (``MPIDIST_GRAPHS=0``)
beside its CUDA graphs; each row says how the passes ran (``graphs``).

``python gpu/bench.py layers --out F``: where a step's GPU time goes, layer
by layer (forward and backward), mpidist beside torch, at batch
:data:`LAYERS_BATCH` (``bench --layers``' table, each clock reading waiting
for the GPU).

``python gpu/bench.py precision --out F``: digits and mnist1d trained on the
GPU in float32, bf16 and fp16 (the same seed and epochs): each one's test
accuracy and its difference from float32's, in points.

``mpiexec -n 2 python gpu/bench.py send --out F``: the bytes of one activation
sent from rank 0 to rank 1 as the pipeline sends them (``runtime.comm.send``:
device to device where MPI is CUDA-aware, staged through the host where not),
against a cupy device-to-device copy of the same bytes, on each path MPI offers
and by the IPC link a stage uses towards a neighbour on its node (``ipc``);
and the pieces of a host-staged send: device to host (pageable and pinned
memory) and MPI between host buffers.
"""

import argparse
import functools
import json
import os
import sys

import numpy as np

BATCHES = (256, 1024, 4096)
MODELS = {"mlp-wide": "MLP 784-512-512-10", "cnn": "cnn"}
SEND_MIB = (1, 16, 64)
#: the batch of the per-layer table
LAYERS_BATCH = 1024
#: --precision's compute types, and the torch dtype autocast runs the reference in
PRECISIONS = {"float32": None, "bf16": "bfloat16"}
#: the datasets and epochs the precision runs train
ACCURACY_RUNS = {"digits": 10, "mnist1d": 10}


def _local(name, precision, batch):
    """``(strategy, x, y)``: ``name``'s model in ``precision`` on the GPU, initialised, and a host batch."""
    import cupy

    from mpidist import nn
    from mpidist.bench.rows import SHAPES
    from mpidist.nn.precision import compute_dtype, master_dtype
    from mpidist.parallel import LocalStrategy

    shape, classes = SHAPES[name]
    dtype = compute_dtype(precision)
    model = nn.build_model(name, shape, classes, cupy, dtype)
    local = LocalStrategy(
        model,
        nn.loss_for(classes, cupy),
        lambda size: nn.make_optimizer("sgd", size, 0.01, xp=cupy, dtype=master_dtype(dtype)),
        seed=0,
    )
    local.initialize()
    rng = np.random.default_rng(0)
    return local, rng.random((batch,) + model.input_shape, dtype=np.float32), rng.integers(0, classes, batch)


def _eager(name, precision, batch):
    """:func:`_local`'s strategy with its passes eager (``MPIDIST_GRAPHS=0``)."""
    before = os.environ.get("MPIDIST_GRAPHS")
    os.environ["MPIDIST_GRAPHS"] = "0"
    try:
        return _local(name, precision, batch)[0]
    finally:
        if before is None:
            del os.environ["MPIDIST_GRAPHS"]
        else:
            os.environ["MPIDIST_GRAPHS"] = before


def models(seconds):
    import cupy

    from mpidist.bench.reference import torch_step
    from mpidist.bench.timing import alternating

    try:  # (without torch the rows are mpidist's alone)
        import torch
    except ImportError:
        torch = None
    else:  # float32 as it is written: torch would otherwise run its convolutions in TF32 (cuDNN's default)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    rows, float32_rate = [], {}
    for precision, autocast in PRECISIONS.items():
        for name, label in MODELS.items():
            for batch in BATCHES:
                local, x, y = _local(name, precision, batch)
                x_gpu, y_gpu = cupy.asarray(x.astype(local.model.dtype)), cupy.asarray(y)
                stream = cupy.cuda.get_current_stream()
                counter = iter(range(1 << 30))

                def ours(local=local):
                    local.train_step(x_gpu, y_gpu, 1.0, next(counter))
                    stream.synchronize()

                steps = {"mpidist": ours}
                if precision == "float32":  # (the same step without CUDA graphs: what they are worth)
                    steps["mpidist eager"] = functools.partial(ours, _eager(name, precision, batch))
                # (torch starts from a float32 twin's parameters: it cannot take bfloat16 arrays)
                twin = local if autocast is None else _local(name, "float32", batch)[0]
                theirs = torch_step(twin.model, x, y, device="cuda", autocast=autocast)
                if theirs is not None:
                    steps["torch"] = theirs
                medians = alternating(steps, seconds)
                rate = batch / medians["mpidist"]
                row = {"model": label, "precision": precision, "batch": batch, "mpidist samples/s": rate}
                row["graphs"] = local.stats().get("graphs")
                if "mpidist eager" in medians:
                    row["graphs/eager"] = medians["mpidist eager"] / medians["mpidist"]
                if "torch" in medians:
                    row["torch samples/s"] = batch / medians["torch"]
                    row["mpidist/torch"] = medians["torch"] / medians["mpidist"]
                if precision == "float32":
                    float32_rate[label, batch] = rate
                else:
                    row["mpidist bf16/float32"] = rate / float32_rate[label, batch]
                rows.append(row)
                print(row, flush=True)
    from mpidist.nn import pool_kernels
    from mpidist.nn.cudnn_conv import PATHS

    # (which path the convolutions' shapes took: cuDNN's, or mpidist's own and why; the pools' kernels)
    rows.append({"convolution shapes by path": dict(PATHS)})
    failed = pool_kernels.FAILED
    rows.append({"max pooling": f"array form: {failed[0]}" if failed else "kernels"})
    print(rows[-2:], flush=True)
    return rows


def precision(seconds):
    """Each dataset trained on the GPU in every precision (``seconds`` unused: a run takes what it
    takes)."""
    import subprocess
    import tempfile

    rows = []
    for data, epochs in ACCURACY_RUNS.items():
        accuracy = {}
        for name in ("float32", "bf16", "fp16"):
            with tempfile.TemporaryDirectory() as scratch:
                metrics = os.path.join(scratch, "m.jsonl")
                flags = ["--data", data, "--epochs", str(epochs), "--device", "gpu", "--precision", name]
                subprocess.run(
                    [sys.executable, "-m", "mpidist", "train", *flags, "--metrics", metrics, "--run-dir", ""],
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
                with open(metrics) as file:
                    done = [json.loads(line) for line in file if '"done"' in line][-1]
            accuracy[name] = done["test_accuracy"]
            row = {"data": data, "precision": name, "test accuracy %": 100 * accuracy[name]}
            row["points from float32"] = 100 * (accuracy[name] - accuracy["float32"])
            rows.append(row)
            print(row, flush=True)
    return rows


def send(seconds):
    """Each size: the pipeline's send on every path MPI offers, and the pieces a host-staged send is made
    of."""
    import cupy
    from mpi4py import MPI

    from mpidist.bench.timing import alternating, synced_timed
    from mpidist.runtime import comm

    world = MPI.COMM_WORLD
    rank = world.Get_rank()

    def until_received(send_one, receive_one):
        """One message from rank 0 to rank 1, timed until the receiver has it (a Barrier after)."""
        return lambda: (send_one() if rank == 0 else receive_one(), world.Barrier())

    stream = cupy.cuda.get_current_stream()
    paths = ["0", "1"] if comm.cuda_aware() else ["0"]
    rows = []
    for mib in SEND_MIB:
        array = cupy.arange(mib << 18, dtype=cupy.float32)  # mib MiB of float32
        host = np.empty(array.shape, dtype=array.dtype)
        row = {"MiB": mib}
        for aware in paths:
            os.environ["MPIDIST_CUDA_AWARE"] = aware
            comm.cuda_aware.cache_clear()
            if rank == 1:
                array.fill(-1)
            label = "cuda-aware" if aware == "1" else "host-staged"
            seconds_each = synced_timed(
                world,
                until_received(
                    lambda: comm.send(world, array, 1, 7),
                    lambda: (comm.recv(world, array, 0, 7), stream.synchronize()),
                ),
                seconds,
            )
            if rank == 1:
                expected = cupy.arange(mib << 18, dtype=cupy.float32)
                assert bool((array == expected).all()), "the received activation differs from the sent one"
            row[f"{label} send GB/s"] = array.nbytes / seconds_each / 1e9
        row["ipc send GB/s"] = _ipc_send(world, array, stream, seconds, until_received)
        # a host-staged send is: device to host, MPI between host buffers, host to device
        row["MPI host send GB/s"] = (
            array.nbytes
            / synced_timed(
                world, until_received(lambda: world.Send(host, 1, 8), lambda: world.Recv(host, 0, 8)), seconds
            )
            / 1e9
        )
        if rank == 0:
            copy_into = cupy.empty_like(array)
            pinned = cupy.cuda.alloc_pinned_memory(array.nbytes)
            pinned_host = np.frombuffer(pinned, array.dtype, array.size)
            medians = alternating(
                {
                    "cupy copy": lambda: (copy_into.__setitem__(Ellipsis, array), stream.synchronize()),
                    "to host": lambda: array.get(),
                    "to pinned host": lambda: array.get(out=pinned_host),
                },
                seconds / 2,
            )
            for name, value in medians.items():
                row[f"{name} GB/s"] = array.nbytes / value / 1e9
            rows.append(row)
            print(row, flush=True)
    comm.cuda_aware.cache_clear()
    return rows if rank == 0 else None


def _ipc_send(world, array, stream, seconds, until_received):
    """GB/s of ``array`` sent from rank 0 to rank 1 by the pipeline's IPC link (device to device, MPI carrying
    the header): what a stage sends its neighbour on one node by."""
    import cupy

    from mpidist.bench.timing import synced_timed
    from mpidist.runtime.cuda_ipc import CudaMemory
    from mpidist.runtime.ipc_link import IpcLink

    comms = [world.Dup(), world.Dup()]
    link = IpcLink(*comms, 1 - world.Get_rank(), CudaMemory())
    if world.Get_rank() == 1:
        array.fill(-1)
    seconds_each = synced_timed(
        world,
        until_received(lambda: link.isend(array, 9)[0].Wait(), lambda: link.recv(array, 9)),
        seconds,
    )
    if world.Get_rank() == 1:
        expected = cupy.arange(array.size, dtype=array.dtype)
        assert bool((array == expected).all()), "the activation received by IPC differs from the sent one"
    stream.synchronize()
    link.close()
    for comm in comms:
        comm.Free()
    return array.nbytes / seconds_each / 1e9


def layers(seconds):
    """Each model's per-layer rows on the GPU (mpidist beside torch, TF32 off)."""
    import cupy

    from mpidist.bench.layers import layer_rows

    try:
        import torch
    except ImportError:
        pass
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    rows = []
    for name in MODELS:
        for row in layer_rows(name, LAYERS_BATCH, seconds, xp=cupy):
            rows.append({"table": "layers", "batch": LAYERS_BATCH, **row})
            print(row, flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("models", "layers", "send", "precision"))
    parser.add_argument("--out", required=True, help="JSON file for the rows")
    parser.add_argument("--seconds", type=float, default=1.5, help="time per measurement")
    args = parser.parse_args()
    rows = {"models": models, "layers": layers, "send": send, "precision": precision}[args.what](args.seconds)
    if rows is not None:
        with open(args.out, "w") as file:
            json.dump(rows, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
