"""The strategy interface (:class:`Strategy`, :class:`StepResult`) and the checks every strategy shares.

Beside the interface: the finite check of a gradient, the skip counter of a
ps that is not in lockstep, and synchronised BatchNorm.  The replicated
data-parallel step is :mod:`mpidist.parallel.data.replicated`.

A strategy owns the model's flat buffers and its optimizer(s).  The training
loop hands it this worker's part of each global batch; the strategy runs
forward/backward (pure ``nn`` code), exchanges what its scheme exchanges, and
applies the optimizer.  Strategies never parse flags and never print.
"""

import dataclasses
import math

from ..nn import BatchNorm, SoftmaxCrossEntropy, scores
from ..nn.sequential import walk
from ..runtime import comm as mpi
from ..runtime.errors import RunError
from .declared import Declared
from .optimizer_factory import OptimizerFactory
from .passes import Passes
from .recipe import Recipe
from .saved_state import SavedState


def start_counting(figures, **initial):
    """Start ``figures`` (a strategy's) at ``initial``, unless an earlier strategy of the run did: the loop's
    figures outlive a strategy built again for the survivors of a lost rank (``--elastic``), which counts
    on."""
    for name, value in initial.items():
        figures.setdefault(name, value)


def finite(array):
    """Whether every element of ``array`` is finite: its squared norm, one BLAS pass and no temporary.

    A NaN or Inf anywhere makes the norm NaN or Inf; so does a norm above
    about 1.8e19 in float32, which only a diverging run reaches.  Measured on
    the 669,707 gradients of mlp-wide: 0.05 ms, against 0.08 ms for
    ``isfinite().all()`` and 0.14 ms for a sum.
    """
    return math.isfinite(float(array.dot(array)))


def synchronise_batch_norms(model, comm):
    """Make every ``BatchNorm(sync=True)`` of ``model`` sum its statistics over ``comm`` (one Allreduce each).

    With ``comm`` None (one worker) they keep their local statistics, which then are the global ones.
    """
    for _, layer in walk(model.layers):
        if isinstance(layer, BatchNorm) and layer.sync and comm is not None:
            layer.reduce = lambda array, comm=comm: mpi.allreduce_sum(comm, array)


class SkipCounter:
    """A ps of a strategy not in lockstep: updates skipped in a row, and the end of patience.

    Args:
        patience: skipped updates in a row that are tolerated (``--nan-patience``).
        speaks: whether this ps ends the job when patience runs out; where every
            ps takes the same decision, one speaking for all gives one message.
        figures: the strategy's figures, where the total is counted (``skipped``).
    """

    def __init__(self, patience, speaks=True, figures=None):
        self.patience, self.speaks = int(patience), speaks
        self.in_row = 0
        self.figures = {} if figures is None else figures
        self.figures.setdefault("skipped", 0)

    @property
    def total(self):
        """Updates skipped over the whole run."""
        return self.figures["skipped"]

    def update_allowed(self, ok, what):
        """``ok``: the update about to be applied is finite.  Past the patience, raise :class:`RunError`."""
        if ok:
            self.in_row = 0
            return True
        self.in_row += 1
        self.figures["skipped"] += 1
        if self.in_row > self.patience and self.speaks:
            raise RunError(
                f"{what} NaN or Inf {self.in_row} time(s) in a row (--nan-patience {self.patience}): "
                "training diverged; lower --lr, or check the data"
            )
        return False  # counted: the ps reports ``skipped`` in the done event


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one training step tells the loop.

    Attributes:
        loss: the global batch's mean loss (NaN where this rank does not know it).
        skipped: the update was skipped (NaN or Inf in the loss or gradients);
            lockstep strategies answer alike on every rank.
        step: the run's step after this one (the global version with backup workers).
        stop: a stop request (signal, callback) has reached this rank.
        finished: the strategy has taken its last step (backup workers' ps decide it).
        clipped: the update was clipped to ``--clip-norm`` (where this rank knows it).
    """

    loss: float
    skipped: bool
    step: int
    stop: bool = False
    finished: bool = False
    clipped: bool = False


class Strategy(Declared, SavedState):
    """Interface every strategy implements (what it is: :class:`~mpidist.parallel.declared.Declared`).

    Args:
        model: a :class:`mpidist.nn.Sequential` (every rank builds one; ps ranks
            use only its size).
        loss: a loss from :mod:`mpidist.nn.losses`.
        make_optimizer: ``size -> Optimizer``; a strategy sizes its optimizer
            to what it updates (the whole buffer, or a ps shard).
        cluster: this rank's :class:`mpidist.runtime.cluster.Cluster` (None for a bare local run).
        seed: run seed (dropout streams derive from it).
        bucket_bytes: largest single exchange, where the strategy buckets.
        where: the rank's :class:`~mpidist.observe.stall.Whereabouts` (what the stall
            monitor reports), or None.
        figures: the dict where the strategy counts its figures (``stats``). The
            loop passes one that outlives the strategy, so a strategy built again
            for the survivors of a lost rank (``--elastic``) counts on.
        recipe: the :class:`~mpidist.parallel.recipe.Recipe` around the optimizer
            (learning rate per step, clipping, accumulation); default: none of them.
    """

    # -- What the running strategy reports: class defaults, set on the instance as it runs --
    #: Strategies that are not in lockstep pass a stop request on themselves:
    #: :meth:`request_stop` on the rank that got the signal, ``stop_requested``
    #: wherever their traffic has carried it (train loop, at step boundaries).
    stop_requested = False
    #: Lockstep strategies: whether the last step's update was skipped because the
    #: loss or gradients were NaN or Inf -- the same answer on every rank, so the
    #: training loop can count such steps and stop everywhere at once.  Strategies
    #: that are not in lockstep skip on the ps and count there (see --nan-patience).
    skipped = False
    #: Whether the last step's update was clipped to ``--clip-norm`` (where this rank knows it).
    clipped = False
    #: True once the strategy has taken the run's last step on its own count.
    finished = False
    #: Largest ps shard over the mean, minus one (None: no shards).
    imbalance = None

    def request_stop(self, signal_number):
        """Ask every rank to stop soon (only strategies that are not in lockstep need this)."""

    def __init__(
        self,
        model,
        loss,
        make_optimizer=None,
        cluster=None,
        seed=0,
        bucket_bytes=64 << 20,
        where=None,
        figures=None,
        recipe=None,
    ):
        self.model, self.loss, self.cluster = model, loss, cluster
        self.recipe = recipe or Recipe()
        #: this worker's forward and backward passes (``--accumulate``'s slices) and the training figures they
        #: count; its ``seed`` is the run's (dropout streams and initial parameters derive from it)
        self.passes = Passes(model, loss, self.recipe.accumulate, seed)
        model.use_workspace(loss)
        #: this rank's optimizers, of the slices it updates (``make(size, offset)``)
        self.optimizers = OptimizerFactory(make_optimizer, model.decay_ranges())
        self.bucket_bytes = int(bucket_bytes)
        self.where = where
        self.figures = {} if figures is None else figures
        # what evaluate() sums: classes from the whole model's outputs, or the regression targets' width
        self.scoring = scores.scoring(isinstance(loss, SoftmaxCrossEntropy), model.output_shape)

    def track(self, phase):
        """Note where this rank is now (``compute``, ``exchange``, ...; see :mod:`mpidist.observe.stall`)."""
        if self.where is not None:
            self.where.enter(phase)

    def describe(self, rank):
        """This rank's part in the role table beyond its device: its ps shard, its pipeline stage, or ''."""
        return ""

    def produced_step(self, step):
        """The run's step after the training step taken at ``step``."""
        return step + 1

    def step(self, x, y, weight, step):
        """One training step (:meth:`train_step`) as a :class:`StepResult`: the loop's only call per step."""
        loss = self.train_step(x, y, weight, step)
        return StepResult(
            loss=loss,
            skipped=self.skipped,
            step=self.produced_step(step),
            stop=self.stop_requested,
            finished=self.finished,
            clipped=self.clipped,
        )

    def serve(self, control):
        """ps ranks of strategies that serve (``serves``): answer workers until the run ends."""
        raise NotImplementedError(f"{type(self).__name__} has no serving loop")

    @property
    def is_worker(self):
        """Whether this rank computes gradients (False on parameter servers)."""
        return self.cluster is None or self.cluster.role == "worker"

    @property
    def worker_comm(self):
        """Communicator over which evaluation counts are summed (None: this process alone)."""
        return None if self.cluster is None else self.cluster.workers

    @property
    def worker_index(self):
        return 0 if self.cluster is None else self.cluster.worker_index

    def initialize(self, checkpoint=None):
        """Collective: starting parameters (the chief's init, or ``checkpoint``'s) and optimizer state."""
        raise NotImplementedError

    def train_step(self, x, y, weight, step):
        """One step; returns the global batch's mean loss.

        Args:
            x, y: this worker's part of the global batch (device arrays); None on ps ranks.
            weight: ``len(x) / global batch size``.
            step: global step number (seeds dropout).
        """
        raise NotImplementedError

    def finish(self):
        """Collective: end of training (strategies with background work finish it here)."""

    def stats(self):
        """Per-role figures for the metrics (JSON-serialisable dict)."""
        return {}

    def held_bytes(self):
        """``{"params", "grads", "optimizer_state"}``: the bytes of each this rank holds, or None (not
        reported)."""
        return None

    def free(self, keep=True):
        """Collective: release the MPI resources (windows, communicators, operations) the strategy made;
        once.

        ``keep``: the model's buffers outlive the memory the strategy releases (a node's shared window), as
        copies (True); or at the end of a run, whose trained values are the chief's result alone, the model
        keeps that array as its parameters (the chief's) or none of its values (False: see
        :meth:`~mpidist.parallel.data.replicated.DataParallel.free`)."""

    def backprop(self, x, y, weight, step, before_backward=None, ready=None):
        """This worker's forward and backward passes (:meth:`~mpidist.parallel.passes.Passes.backprop`): fills
        ``model.grads``, returns the loss."""
        self.track("compute")
        return self.passes.backprop(x, y, weight, step, self.worker_index, before_backward, ready)

    def judge(self, verdict, skips=True):
        """Take the step's :class:`~mpidist.parallel.verdict.Verdict`: sets :attr:`skipped` (``skips`` False:
        not this rank's to decide, as a ps-async worker only clips the gradient it sends) and :attr:`clipped`,
        and counts a clipped step in the figures; returns the verdict."""
        if skips:
            self.skipped = verdict.skip
        self.clipped = verdict.clipped
        if verdict.clipped:
            self.figures["clipped"] = self.figures.get("clipped", 0) + 1
        return verdict

    def evaluate(self, batches):
        """The task's figures over ``batches`` of ``(x, y)``, summed over the evaluating ranks.

        A dict (see :mod:`mpidist.nn.scores`): classification ``loss``, ``accuracy``,
        ``top5_accuracy`` (where it applies), ``samples``, ``per_class`` and
        ``confusion``; regression ``loss``, ``mse``, ``mae``, ``r2``, ``samples``.
        Each evaluating worker sums its batches into one vector; one Allreduce sums
        the vectors.  Ranks that do not evaluate (ps) get NaN figures and 0 samples.
        """
        scoring = self.scoring
        if not self.is_worker:
            return scoring.figures(scoring.zeros())
        xp = self.model.xp
        sums = scoring.zeros()
        self.track("compute")
        for x, y in self.passes.in_step(batches):
            x, y = xp.asarray(x), xp.asarray(y)
            out = self.model.forward(x, training=False)
            scoring.add(sums, out, y, float(self.loss.forward(out, y)), xp)
        comm = self.worker_comm if self.evaluation == "sharded" else None
        self.track("exchange")
        return scoring.figures(mpi.sum_float64(comm, sums))

    def recovery(self):
        """What this strategy does for the survivors of a lost rank (``--elastic``): its :attr:`recovery_type`
        (a :class:`~mpidist.parallel.recovery.Recovery`) around it."""
        return self.recovery_type(self)
