"""Which layers each pipeline stage holds: a balance by parameters, ``--balance`` checked, a stage's first
entry.

Pure functions of the model's shapes (no MPI): the pipeline strategy, the
memory check (:mod:`mpidist.parallel.holding`) and ``plan`` cut a model
alike.
"""

import numpy as np

from ...nn.sequential import walk
from ...runtime.errors import UsageError


def balance_by_parameters(costs, stages):
    """Layers per stage, contiguous and non-empty, minimising the largest stage's cost.

    >>> balance_by_parameters([1, 1, 1, 10], 2)
    [3, 1]
    """
    count = len(costs)
    if not 1 <= stages <= count:
        raise ValueError(f"{stages} stages need at least {stages} layers, the model has {count}")
    prefix = np.concatenate([[0], np.cumsum(np.asarray(costs, dtype=np.float64))])
    # best[s][i]: smallest max-cost splitting the first i layers into s stages, cut[s][i] the first j giving
    # it. With positive costs best[s - 1][j] grows with j and the last stage's cost prefix[i] - prefix[j]
    # falls, so the best j is where they cross: a binary search for every i at once (stages x layers x log
    # layers, where trying every j took hours for tens of thousands of layers)
    best = np.full((stages + 1, count + 1), np.inf)
    cut = np.zeros((stages + 1, count + 1), dtype=int)
    best[0][0] = 0
    for s in range(1, stages + 1):
        rises = best[s - 1][s - 1 :] + prefix[s - 1 :]  # (increasing: costs are positive)
        i = np.arange(s, count + 1)
        # the first j in [s - 1, i) with best[s - 1][j] >= prefix[i] - prefix[j], and the one before it
        cross = np.minimum(np.searchsorted(rises, prefix[i], side="left") + (s - 1), i - 1)
        before = np.maximum(cross - 1, s - 1)
        at_cross = np.maximum(best[s - 1][cross], prefix[i] - prefix[cross])
        at_before = np.maximum(best[s - 1][before], prefix[i] - prefix[before])
        take_before = (at_before <= at_cross) & (before < cross)
        best[s][s:] = np.where(take_before, at_before, at_cross)
        cut[s][s:] = np.where(take_before, before, cross)
    sizes, i = [], count
    for s in range(stages, 0, -1):
        j = cut[s][i]
        sizes.append(int(i - j))
        i = j
    return sizes[::-1]


def layer_costs(model):
    """Cost of each layer for balancing: its parameters, plus one so no stage is empty of work."""
    return [model.layer_params(index) + 1 for index in range(len(model.layers))]


def parse_balance(config, model):
    """``--balance`` as layers per stage, checked against the model; None to balance by parameters."""
    names = ", ".join(repr(layer) for layer in model.layers)
    if len(model.layers) < config.stages:
        raise UsageError(
            f"--stages {config.stages} needs at least {config.stages} layers, but --model "
            f"{config.model} has {len(model.layers)}: {names}"
        )
    if not config.balance:
        return None
    try:
        sizes = [int(part) for part in config.balance.split(",")]
    except ValueError:
        raise UsageError(
            f"--balance {config.balance!r}: give layers per stage as integers, e.g. 3,3"
        ) from None
    if len(sizes) != config.stages or sum(sizes) != len(model.layers) or min(sizes) < 1:
        raise UsageError(
            f"--balance {config.balance} gives {len(sizes)} stages with {sum(sizes)} layers, but "
            f"--stages is {config.stages} and --model {config.model} has {len(model.layers)} layers "
            f"({names}); each stage needs at least one"
        )
    return sizes


def first_entry(model, layer):
    """The index in ``model.entries`` of the first parameter of top-level layer ``layer`` (or of those
    after)."""
    before = {id(node) for top in model.layers[:layer] for _, node in walk([top])}
    return sum(1 for owner, *_ in model.entries if id(owner) in before)
