"""A worker's training passes: the figures they count."""

import numpy as np

from mpidist import nn
from mpidist.parallel.passes import Passes


def test_the_training_figures_are_summed_in_float64_over_many_steps():
    """A regression's absolute error per step, float32 arrays: summed as float64 (a float32 sum of 100,000
    steps of 0.1 drifted to 9998.56)."""
    model = nn.Sequential([nn.Dense(1)], (2,), xp=np, dtype=np.float32)
    passes = Passes(model, nn.loss_for(0, np))
    out, target = np.full((1, 1), 0.1, np.float32), np.zeros((1, 1), np.float32)
    for _ in range(100_000):
        passes.loss.forward(out, target)
        passes.count(out, target)
    error, samples = passes.take_counts()
    assert samples == 100_000 and type(error) is float
    assert abs(error - 100_000 * float(np.float32(0.1))) < 1e-6
    assert passes.take_counts() == [0.0, 0]


def test_a_classifications_correct_answers_are_counted_exactly():
    model = nn.Sequential([nn.Dense(3)], (2,), xp=np, dtype=np.float32)
    passes = Passes(model, nn.loss_for(3, np))
    logits = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 0.0, 5.0]], np.float32)
    for labels in ([0, 1, 2], [0, 0, 0]):
        passes.loss.forward(logits, np.array(labels))
        passes.count(logits, np.array(labels))
    assert passes.take_counts() == [4.0, 6]
