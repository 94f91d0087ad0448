"""Evaluation figures that fit the task, from sums that add up over the workers.

Every figure is a ratio of sums.  Each evaluating worker adds its batches
into one float64 vector of *sums* (:meth:`Scoring.add`); the workers' vectors
are summed with one ``Allreduce`` (:func:`mpidist.runtime.comm.sum_float64`), and the
figures are computed from the summed vector (:meth:`Scoring.figures`): never
an average of the workers' ratios, so uneven shards weigh what they hold,
and the figures are those of one process that saw the whole test split.
This module is pure (no MPI): the strategies do the reduction.

Classification (:class:`Classification`, ``K`` classes) sums the loss, the
samples, the samples whose label is among the ``k`` highest outputs
(``k = min(5, K - 1)``; none for 2 classes, where it would always be 1; fewer
than ``k`` outputs above the label's, so ties count in its favour), and
the confusion matrix (true class x predicted class, the predicted class being
the highest output, first on ties).  A model that classifies every position of
a sequence (outputs ``(L, K)``, labels ``(L,)`` per sample: next-token
prediction) is scored token by token: every figure but ``samples`` counts
tokens (``accuracy`` is the fraction of tokens predicted right, ``loss`` the
mean over tokens, ``support`` counts tokens).  Up to :data:`CONFUSION_LIMIT` classes the
whole matrix is summed (``K**2`` numbers); above it, only each class's
support, predictions and correct predictions (``3 K``).  Its figures:

* ``loss``, ``accuracy`` (top-1), ``top{k}_accuracy`` (e.g. ``top5_accuracy``;
  ``top3_accuracy`` for 4 classes; absent for 2), ``samples``;
* ``per_class``: lists over the classes of ``precision`` (correct / predicted),
  ``recall`` (correct / support), ``f1`` (their harmonic mean, ``2 correct /
  (support + predicted)``) and ``support`` (test samples of the class).  A
  class never predicted has precision 0.0, one with no support recall 0.0,
  and one with neither F1 0.0 (scikit-learn's ``zero_division=0``);
* ``confusion``: the matrix as lists of ints, rows the true class (up to
  :data:`CONFUSION_LIMIT` classes only).

Regression (:class:`Regression`, ``W`` targets per sample) sums the loss, the
samples, and per target the squared errors, the absolute errors, ``y`` and
``y**2``.  Its figures: ``loss``, ``mse`` and ``mae`` (means over samples and
targets, so ``mse`` is the MSE loss), ``r2`` and ``samples``.  ``r2`` is
``1 - SSE/SST`` per target, averaged uniformly over the targets as
scikit-learn's ``r2_score``; a target with no variance scores 1.0 where it is
predicted exactly and 0.0 otherwise (scikit-learn's ``force_finite``).  SST
comes from the sums of ``y`` and ``y**2`` (``Σy² - (Σy)²/n``, in float64): a
target whose variance is below ``1e-12`` of its mean square counts as one with
no variance (its variance cannot be told from rounding there).

With no samples (a rank that does not evaluate: a parameter server) every
figure is NaN and ``samples`` is 0.

The metrics events and :func:`mpidist.evaluate` name the figures with a
``test_`` prefix (:func:`headline`, :func:`report`): ``test_per_class`` there
is one record per class, ``{"class", "name" (where the dataset names its
classes), "precision", "recall", "f1", "support"}``, and ``test_confusion`` the matrix.
"""

import math

import numpy as np

from ..runtime.xp import to_host

#: Classes up to which the whole confusion matrix is summed and reported (``K**2``
#: numbers); above it only per-class support, predictions and correct ones (``3 K``).
CONFUSION_LIMIT = 100
#: The ``k`` of the top-k accuracy (fewer where there are not more classes than that).
TOP_K = 5
#: Variance below this fraction of a target's mean square counts as none: the sums that give it
#: (``sum y^2 - (sum y)^2 / n``, in float64) round at about 1e-15 of it, after many batches at 1e-14.
#: So R^2 is computed for targets whose spread is above ~3e-7 of their offset (a mean of 1e6 and a
#: deviation of 1 is), and a target offset further than that counts as constant.
VARIANCE_FLOOR = 1e-13


def top_k(classes):
    """The ``k`` of the top-k accuracy for ``classes`` classes, or 0 where it is not reported (2 classes or
    fewer)."""
    k = min(TOP_K, int(classes) - 1)
    return k if k >= 2 else 0


def scoring(classification, output_shape):
    """The :class:`Scoring` of a model whose outputs are ``output_shape`` (per sample).

    ``classification``: the outputs are logits over classes (cross-entropy
    loss); else they are regression targets (mean squared error).
    """
    width = int(np.prod(output_shape, dtype=np.int64)) if len(output_shape) else 1
    if not classification:
        return Regression(width)
    classes = int(output_shape[-1]) if len(output_shape) else 1
    return Classification(classes, positions=width // max(classes, 1))


class Scoring:
    """What one task sums per evaluation batch, and the figures it makes of the sums."""

    task = None
    size = 0

    def zeros(self):
        """An empty vector of sums (float64 on the host)."""
        return np.zeros(self.size, dtype=np.float64)

    def add(self, sums, outputs, targets, loss, xp=np):
        """Add one batch into ``sums``: the model's ``outputs``, the ``targets``, and the batch's mean
        ``loss``."""
        raise NotImplementedError

    def figures(self, sums):
        """The figures (dict) of the summed vector ``sums``."""
        raise NotImplementedError

    def scalar_names(self):
        """The names of the scalar figures besides ``samples``, in the order they are shown."""
        raise NotImplementedError


class Classification(Scoring):
    """Classification into ``classes`` classes, at ``positions`` positions per sample (1, or a sequence's
    ``L``).

    The layout is ``[loss sum, positions, top-k correct, confusion (K x K,
    row-major) | support (K), predicted (K), correct (K)]``, every count of
    positions (samples where there is one per sample).
    """

    task = "classification"

    def __init__(self, classes, positions=1):
        self.classes, self.positions = int(classes), int(positions)
        self.k = top_k(self.classes)
        self.full_confusion = self.classes <= CONFUSION_LIMIT
        self.size = 3 + (self.classes**2 if self.full_confusion else 3 * self.classes)

    def scalar_names(self):
        return ("loss", "accuracy") + ((f"top{self.k}_accuracy",) if self.k else ())

    def add(self, sums, outputs, targets, loss, xp=np):
        classes = self.classes
        n = len(outputs) * self.positions  # labelled positions: samples, or tokens of sequences
        if n == 0:
            return sums
        logits = outputs.reshape(n, classes)
        labels = targets.reshape(n).astype(xp.int64)
        predicted = logits.argmax(axis=1)
        if self.full_confusion:
            counts = xp.bincount(labels * classes + predicted, minlength=classes * classes)
        else:
            counts = xp.concatenate(
                [
                    xp.bincount(labels, minlength=classes),
                    xp.bincount(predicted, minlength=classes),
                    xp.bincount(labels[predicted == labels], minlength=classes),
                ]
            )
        sums[3:] += to_host(counts)
        if self.k:  # the label is among the k highest: fewer than k outputs above its own
            own = logits[xp.arange(n), labels]
            sums[2] += float((((logits > own[:, None]).sum(axis=1)) < self.k).sum())
        sums[0] += float(loss) * n
        sums[1] += n
        return sums

    def counts(self, sums):
        """``(support, predicted, correct)`` per class (float64 arrays) from ``sums``."""
        body = np.asarray(sums[3:], dtype=np.float64)
        if self.full_confusion:
            matrix = body.reshape(self.classes, self.classes)
            return matrix.sum(axis=1), matrix.sum(axis=0), matrix.diagonal().copy()
        support, predicted, correct = body.reshape(3, self.classes)
        return support, predicted, correct

    def figures(self, sums):
        sums = np.asarray(sums, dtype=np.float64)
        count = int(sums[1])
        if count == 0:
            return dict({name: math.nan for name in self.scalar_names()}, samples=0)
        support, predicted, correct = self.counts(sums)
        figures = {"loss": sums[0] / count, "accuracy": correct.sum() / count}
        if self.k:
            figures[f"top{self.k}_accuracy"] = sums[2] / count
        figures["samples"] = count // self.positions
        figures["per_class"] = {
            "precision": _ratios(correct, predicted),
            "recall": _ratios(correct, support),
            "f1": _ratios(2 * correct, support + predicted),
            "support": [int(s) for s in support],
        }
        if self.full_confusion:
            figures["confusion"] = sums[3:].reshape(self.classes, self.classes).astype(np.int64).tolist()
        return {
            name: float(value) if isinstance(value, np.floating) else value for name, value in figures.items()
        }


class Regression(Scoring):
    """Regression on ``width`` targets per sample: the layout is
    ``[loss sum, samples, squared errors (W), absolute errors (W), sum of y (W), sum of y**2 (W)]``."""

    task = "regression"

    def __init__(self, width):
        self.width = int(width)
        self.size = 2 + 4 * self.width

    def scalar_names(self):
        return ("loss", "mse", "mae", "r2")

    def add(self, sums, outputs, targets, loss, xp=np):
        n = len(outputs)
        if n == 0:
            return sums
        predicted = outputs.reshape(n, self.width).astype(xp.float64)
        target = targets.reshape(n, self.width).astype(xp.float64)
        error = predicted - target
        parts = xp.concatenate(
            [
                (error * error).sum(axis=0),
                xp.abs(error).sum(axis=0),
                target.sum(axis=0),
                (target * target).sum(axis=0),
            ]
        )
        sums[2:] += to_host(parts)
        sums[0] += float(loss) * n
        sums[1] += n
        return sums

    def figures(self, sums):
        sums = np.asarray(sums, dtype=np.float64)
        count, width = int(sums[1]), self.width
        if count == 0:
            return dict({name: math.nan for name in self.scalar_names()}, samples=0)
        sse, sae, sy, syy = sums[2:].reshape(4, width)
        sst = np.maximum(syy - sy * sy / count, 0.0)
        constant = sst <= VARIANCE_FLOOR * syy
        with np.errstate(divide="ignore", invalid="ignore"):
            r2 = np.where(constant, np.where(sse == 0, 1.0, 0.0), 1.0 - sse / np.where(constant, 1.0, sst))
        return {
            "loss": float(sums[0] / count),
            "mse": float(sse.sum() / (count * width)),
            "mae": float(sae.sum() / (count * width)),
            "r2": float(r2.mean()),
            "samples": count,
        }


def _ratios(numerator, denominator):
    """``numerator / denominator`` per class as floats, 0.0 where the denominator is 0."""
    return [float(a / b) if b > 0 else 0.0 for a, b in zip(numerator, denominator)]


def is_classification(figures):
    """Whether ``figures`` (of :meth:`Scoring.figures`) are a classification's."""
    return "accuracy" in figures


def headline(figures, prefix="test_"):
    """The scalar figures of ``figures`` but ``samples``, named with ``prefix``: what each ``eval`` event
    carries.

    Classification: ``test_loss``, ``test_accuracy``, ``test_top5_accuracy`` (its
    ``k``, where it applies); regression: ``test_loss``, ``test_mse``, ``test_mae``, ``test_r2``.
    """
    return {
        prefix + name: value
        for name, value in figures.items()
        if name not in ("samples", "per_class", "confusion")
    }


def report(figures, class_names=None, prefix="test_"):
    """:func:`headline`, and for classification ``test_per_class`` and ``test_confusion`` (where kept).

    ``test_per_class``: one record per class, ``{"class": index, "name": ..., "precision",
    "recall", "f1", "support"}``, ``name`` only where ``class_names`` gives one.
    """
    out = headline(figures, prefix)
    per_class = figures.get("per_class")
    if per_class is not None:
        names = list(class_names) if class_names is not None else []
        records = []
        for index, values in enumerate(
            zip(per_class["precision"], per_class["recall"], per_class["f1"], per_class["support"])
        ):
            record = {"class": index}
            if index < len(names):
                record["name"] = str(names[index])
            record.update(zip(("precision", "recall", "f1", "support"), values))
            records.append(record)
        out[prefix + "per_class"] = records
    if figures.get("confusion") is not None:
        out[prefix + "confusion"] = figures["confusion"]
    return out


def summary_rows(figures):
    """``(label, value)`` rows of the scalar figures for the closing summary table."""
    if is_classification(figures):
        rows = [
            ("test loss", f"{figures['loss']:.4f}"),
            ("test accuracy", f"{100 * figures['accuracy']:.2f}%"),
        ]
        return rows + [
            (f"test top-{name[3 : -len('_accuracy')]} accuracy", f"{100 * value:.2f}%")
            for name, value in figures.items()
            if name.startswith("top") and name.endswith("_accuracy")
        ]
    # (errors on the targets' scale: significant digits, not decimals)
    return [
        ("test loss", digits4(figures["loss"])),
        ("test MSE", digits4(figures["mse"])),
        ("test MAE", digits4(figures["mae"])),
        ("test R^2", f"{figures['r2']:.4f}"),
    ]


def digits4(value):
    """An error on the targets' scale, to 4 significant digits, trailing zeros kept (0.1200) but not a
    trailing point (3581, not ``#.4g``'s 3581.)."""
    text = f"{value:#.4g}"
    return text[:-1] if text.endswith(".") else text


def progress_text(figures, split="test"):
    """The figures of an evaluation of ``split`` (test or val) on one progress line."""
    if is_classification(figures):
        return f"{split} loss {figures['loss']:.4f}  {split} accuracy {100 * figures['accuracy']:5.1f}%"
    return (
        f"{split} loss {digits4(figures['loss'])}  {split} MSE {digits4(figures['mse'])}  "
        f"MAE {digits4(figures['mae'])}  R^2 {figures['r2']:.4f}"
    )
