"""Train, then predict: a checkpoint's predictions on new samples, each rank its own block of rows.

Every rank calls :func:`mpidist.predict` with the same arguments; rank 0 gathers
the predictions in input order, writes them (``class`` and ``probabilities``
here) and holds them as arrays::

    mpiexec -n 2 python examples/predict.py

The command line does the same: ``python -m mpidist predict CHECKPOINT --output preds.h5``.
"""

import shutil
import tempfile
from pathlib import Path

import h5py
from mpi4py import MPI

import mpidist

if __name__ == "__main__":
    world = MPI.COMM_WORLD
    directory = Path(
        world.bcast(tempfile.mkdtemp(prefix="mpidist-predict-") if world.Get_rank() == 0 else None)
    )
    result = mpidist.train(
        "mlp",
        "digits",
        epochs=10,
        run_dir=str(directory / "run"),
        checkpoint_dir=str(directory / "ck"),
        progress="none",
        metrics="",
    )
    checkpoint = world.bcast(str(result.checkpoints[-1]) if result.is_chief else None)
    evaluated = mpidist.evaluate(checkpoint)
    # the test split of the dataset the checkpoint trained on, written to preds.h5
    predictions = mpidist.predict(checkpoint, output=directory / "preds.h5")
    # plain samples (a numpy array, the same on every rank): predicted, not written
    with h5py.File(predictions.output, "r") as handle:
        source = handle.attrs["data"]  # the dataset predicted, as the file records it
    with h5py.File(source, "r") as handle:
        first = handle["test/x"][:5]
    few = mpidist.predict(checkpoint, first)
    if world.Get_rank() == 0:
        print(f"the first classes predicted: {predictions.classes[:10].tolist()}")
        print(f"the first five again, as plain samples: {few.classes.tolist()}")
        print(f"eval's test accuracy: {100 * evaluated['test_accuracy']:.2f}%")
        print(
            f"predict: {predictions.samples} samples of {predictions.source}, test accuracy "
            f"{100 * predictions.figures['accuracy']:.2f}%"
        )
        shutil.rmtree(directory)
