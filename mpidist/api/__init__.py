"""The Python API: :func:`train` and :func:`evaluate`, the one path every run takes, and :func:`load_trained`.

``python -m mpidist train`` and ``eval`` are thin clients of these two
functions: they turn flags into :class:`~mpidist.settings.config.Settings` and call
them, so a script and the command line run the very same code.
:func:`load_trained` is the one way a checkpoint becomes a model again:
``evaluate``, ``predict`` and scripts all load and check it through it.

Every rank of the job calls them with the same arguments (the script runs
under ``mpiexec -n N``).  Errors never leave ranks waiting: bad settings,
model or data are agreed on by every rank before any collective (one
message, every rank raises ``SystemExit(2)``), and an exception on any rank
afterwards -- a bug, a failed write, a callback that raised -- prints its
traceback and ends the whole job through ``MPI_Abort`` (exit code 1).

One module per entry point, each imported from here (``mpidist.api.train``,
``mpidist.api.load_trained``, ...):

* :mod:`~mpidist.api.training`: :func:`train` and the :class:`Result` it returns;
* :mod:`~mpidist.api.evaluation`: :func:`evaluate`, a checkpoint's test figures;
* :mod:`~mpidist.api.trained`: :func:`load_trained` (and :func:`load_split`, its
  form for a model split over the ranks), a checkpoint's model built again.
"""

from .evaluation import evaluate
from .trained import Trained, load_split, load_trained
from .training import Result, train

__all__ = ["train", "Result", "evaluate", "load_trained", "load_split", "Trained"]
