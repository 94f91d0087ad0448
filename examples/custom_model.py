"""A model of your own from mpidist.nn layers: a residual MLP with synchronised BatchNorm.

``BatchNorm(sync=True)`` normalises with the statistics of the *global* batch,
summed over the data-parallel workers, so N workers train exactly as one
process on the whole batch would (as PyTorch's SyncBatchNorm)::

    mpiexec -n 2 python examples/custom_model.py
"""

import mpidist
from mpidist import nn


def build(sample_shape, outputs):
    """``(sample_shape, outputs) -> layers``: called on every rank with the dataset's shapes."""

    def block():
        return nn.Residual(nn.Dense(64), nn.BatchNorm(sync=True), nn.GELU(), nn.Dense(64))

    return [
        nn.Flatten(),
        nn.Dense(64),
        block(),
        nn.ReLU(),
        block(),
        nn.ReLU(),
        nn.Dense(outputs, init="glorot"),
    ]


if __name__ == "__main__":
    result = mpidist.train(build, "digits", strategy="allreduce", epochs=15, progress="none", metrics="")
    if result.is_chief:
        print(
            f"custom_model: {result.model.num_params:,} parameters, "
            f"test accuracy {100 * result.test_accuracy:.2f}%"
        )
