"""Callbacks: follow a run and stop it early, on every rank at once.

``EarlyStopping`` stops when the test accuracy has not improved for
``patience`` evaluations; ``Printer`` shows what a callback receives (the
figures of the metrics events, on the chief)::

    mpiexec -n 2 python examples/early_stopping.py
"""

import mpidist


class Printer(mpidist.Callback):
    """Print each evaluation, and how the run ended."""

    def on_eval(self, figures):
        print(f"  epoch {figures['epoch']:>2}: test accuracy {100 * figures['test_accuracy']:.2f}%")

    def on_end(self, figures):
        print(f"  ended ({figures['event']}) after {figures['steps']} steps")


if __name__ == "__main__":
    stopper = mpidist.EarlyStopping(patience=2, min_delta=0.002)
    result = mpidist.train(
        "mlp", "digits", epochs=60, callbacks=[stopper, Printer()], progress="none", metrics=""
    )
    if result.is_chief:
        stopped = f"stopped early at step {stopper.stopped_at}" if stopper.stopped_at else "ran every epoch"
        print(f"early_stopping: {stopped}, test accuracy {100 * result.test_accuracy:.2f}%")
