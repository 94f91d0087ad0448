"""A rehearsal measures what a model's passes hold before a run holds anything: at least what a real step's
workspace and a real evaluation's arrays take, for every kind of layer, whatever the batch."""

import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest

from mpidist import nn
from mpidist.nn import zoo
from mpidist.nn.rehearsal import PROBE, rehearse

MODELS = {
    "mlp": ("mlp:64,32", (20,)),
    "cnn": ("cnn:4,8", (12, 12)),
    "transformer": ("transformer:1,16,2", (12,)),
}


def built(name, buffers):
    spec, shape = MODELS[name]
    return zoo.build_model(spec, shape, 5, np, np.float32, buffers=buffers)


def real_inference_peak(model, batch):
    """Bytes a real evaluation pass holds at its peak over what it was given (numpy's arrays, traced)."""
    x = np.zeros((batch, *model.input_shape), dtype=np.float32)
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        model.forward(x, training=False)
        return tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("batch", [3, 40])
def test_a_rehearsal_holds_at_least_a_real_steps_workspace_and_a_real_evaluations_arrays(name, batch):
    evaluation = 2 * PROBE + 37  # (measured at PROBE and twice that, carried on to the batch)
    passes = rehearse(built(name, buffers=False), batch, evaluation)
    model = built(name, buffers=True)
    x = np.zeros((batch, *model.input_shape), dtype=np.float32)
    out = model.forward(x, training=True)
    model.backward(np.ones_like(out))
    assert model.workspace.nbytes <= passes.step < 4 * model.workspace.nbytes + (1 << 20)
    assert real_inference_peak(model, evaluation) <= passes.evaluation


def test_a_rehearsal_leaves_the_model_as_it_found_it_and_runs_masks_in_order():
    embedding = nn.Embedding(10, 4, pad_id=0)
    layers = [
        embedding,
        nn.PositionalEmbedding(5),
        nn.TransformerBlock(2, mlp_ratio=1, padding=embedding),  # (reads the embedding's padding mask)
        nn.SequencePool(padding=embedding),
        nn.Dense(3),
    ]
    model = nn.Sequential(layers, (5,), buffers=False)
    passes = rehearse(model, 7, 300)
    assert passes.step > 0 and passes.evaluation > passes.step
    for layer, name, *_ in model.entries:  # (a map of shapes still: no parameters bound)
        assert layer.params.get(name) is None and layer.grads.get(name) is None
    assert all(node.workspace is model.workspace for _, node in nn.parameter_map.walk(model.layers))


def test_a_rehearsal_of_a_range_of_layers_holds_theirs_alone():
    model = built("mlp", buffers=False)
    whole = rehearse(model, 16, 0).step
    first, rest = rehearse(model, 16, 0, 0, 2).step, rehearse(model, 16, 0, 2).step
    assert 0 < first < whole and 0 < rest < whole and whole <= first + rest


def test_a_settled_process_holds_what_it_uses_and_its_blas_buffers_already():
    """glibc kept what a freed block of up to 32 MiB held, by default; OpenBLAS allocated its buffers at the
    first large product: a process's memory was its history."""
    script = textwrap.dedent(
        """
        import numpy as np
        from mpidist.runtime import memory
        memory.settle()
        before = memory.in_use()
        for size in (4 << 20, 16 << 20, 30 << 20):
            block = np.ones(size // 8)
            del block
        square = np.ones((700, 700), dtype=np.float32)
        np.dot(square, square)
        del square
        print(memory.in_use() - before, memory.thread_bytes())
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    grown, thread = (int(word) for word in done.stdout.split())
    assert grown < 2 << 20, grown
    assert (1 << 20) <= thread <= 64 << 20, thread
