"""The small model and the batch slices the strategies' tests share (a module, not a test: never
collected)."""

import numpy as np

from mpidist.data import local_batch_size
from mpidist.nn import Conv2D, Dense, Flatten, MaxPool2D, ReLU, Sequential


def small_convnet(dtype):
    layers = [Conv2D(3, 3), ReLU(), MaxPool2D(2), Flatten(), Dense(8), ReLU(), Dense(4, init="glorot")]
    return Sequential(layers, (1, 6, 6), xp=np, dtype=dtype)


def worker_slice(global_batch, workers, worker):
    sizes = [local_batch_size(global_batch, workers, w) for w in range(workers)]
    lo = sum(sizes[:worker])
    return slice(lo, lo + sizes[worker])
