"""Train on numpy arrays in memory: every rank passes the same arrays, each worker trains on its shard.

The task: which of three noisy rings a 2-D point lies on; the arrays are made
here with a fixed seed, so every rank builds the very same ones::

    mpiexec -n 2 python examples/arrays.py
"""

import numpy as np

import mpidist


def rings(samples, seed):
    """``(x, y)``: points near circles of radius 1, 2 and 3 (labels 0, 1, 2)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, samples)
    angle = rng.uniform(0, 2 * np.pi, samples)
    radius = 1.0 + y + rng.normal(0, 0.15, samples)
    x = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1).astype(np.float32)
    return x, y


if __name__ == "__main__":
    data = mpidist.ArrayData(train=rings(4000, seed=1), test=rings(1000, seed=2), name="rings")
    result = mpidist.train("mlp:32,32", data, epochs=10, progress="none", metrics="")
    if result.is_chief:
        print(f"arrays: test accuracy {100 * result.test_accuracy:.2f}%")
