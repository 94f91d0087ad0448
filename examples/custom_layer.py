"""A layer of your own: a parametric ReLU with one learned slope per unit, in an MLP.

Run it under any strategy, for example::

    mpiexec -n 4 python examples/custom_layer.py --strategy allreduce
    mpiexec -n 4 python examples/custom_layer.py --strategy ps-sync --ps 1
    mpiexec -n 4 python examples/custom_layer.py --strategy pipeline --stages 2

or give its builder to the command line, which stores it in checkpoints so
``eval`` and ``--resume`` rebuild the same model::

    mpiexec -n 2 python -m mpidist train --model examples/custom_layer.py:build --data digits

Before training, ``nn.check_gradients`` checks the layer's ``backward``
against finite differences (a wrong gradient trains, only worse: check it).
"""

import argparse

import mpidist
from mpidist import nn


class PReLU(nn.Layer):
    """``y = x`` where ``x > 0``, else ``alpha * x``, with one learned ``alpha`` per unit: ``(N, D) -> (N,
    D)``."""

    cache = ("x",)  # what forward leaves for backward (a pipeline keeps one per micro-batch)

    def build(self, input_shape):
        self.units = input_shape[-1]
        return input_shape

    def param_specs(self):
        # (name, shape, initialiser(rng, shape)): the model puts every parameter in one flat buffer
        return [("alpha", (self.units,), lambda rng, shape: [0.25] * shape[0])]

    def forward(self, x, training=False):
        self.x = x
        return self.xp.where(x > 0, x, self.params["alpha"] * x)

    def backward(self, dy):
        negative = self.xp.minimum(self.x, 0)
        self.grads["alpha"][...] = (dy * negative).sum(axis=0)  # overwrite: one backward fills all gradients
        return self.xp.where(self.x > 0, dy, self.params["alpha"] * dy)


def build(sample_shape, outputs):
    """The model for samples of ``sample_shape`` and ``outputs`` classes: mpidist calls it on every rank."""
    return [nn.Flatten(), nn.Dense(64), PReLU(), nn.Dense(64), PReLU(), nn.Dense(outputs, init="glorot")]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--ps", type=int, default=0)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()
    # every rank: a few dozen forward passes, no MPI; a wrong backward raises nn.GradientError naming the
    # entry
    nn.check_gradients(PReLU(), input_shape=(8,))
    result = mpidist.train(
        build,
        "digits",
        strategy=args.strategy,
        ps=args.ps,
        stages=args.stages,
        epochs=args.epochs,
        progress="none",
        metrics="",
    )
    if result.is_chief:
        print("custom_layer: PReLU's gradients match finite differences")
        print(f"custom_layer: {args.strategy} test accuracy {100 * result.test_accuracy:.2f}%")
