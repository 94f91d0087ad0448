"""The command line's grammar: the parser of ``python -m mpidist`` and of its subcommands, and :func:`parse`.

Every rank parses the same command line, with a parser that raises
:class:`~mpidist.runtime.errors.UsageError` instead of exiting, so that the
error is agreed on (:mod:`mpidist.tools.cli` parses under
:func:`~mpidist.runtime.agreement.agreed`); only world rank 0 prints help and
usage text.  The flags of ``train`` come from the settings
(:func:`mpidist.settings.sources.add_flags`), those of ``bench`` and ``plan``
from :mod:`mpidist.tools.measuring_flags`; the other subcommands' flags are
here.  What each subcommand runs is :mod:`mpidist.tools.cli`'s.
"""

import argparse
import re
import sys

from mpi4py import MPI

from .. import __version__
from ..runtime.errors import UsageError
from ..runtime.suggest import did_you_mean
from ..runtime.text import check_utf8
from .measuring_flags import add_bench_parser, add_plan_parser

COMMANDS = ("train", "eval", "predict", "ingest", "info", "bench", "plan")
#: Arguments that are paths (of any command), checked as the absolute paths they stand for too where given
#: (``--data`` and ingest's source may be names, not paths: the commands check the paths they stand for).
PATHS = (
    "checkpoint_dir",
    "run_dir",
    "metrics",
    "config",
    "resume",
    "checkpoint",
    "output",
    "runs",
    "streaming",
    "tracing",
    "calibration",
    "check",
)


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, prints on rank 0 only, and takes no abbreviations.

    Abbreviations are off because a job script that says ``--epoch`` would
    silently change meaning the day a second flag starting with it is added.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(f"{message}{self._near(message)} (see `{self.prog} --help`)")

    def _near(self, message):
        """A mistyped flag's or choice's nearest known one (``" (did you mean --epochs?)"``), or nothing."""
        choice = re.match(r".*invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:
            return did_you_mean(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
        if not message.startswith("unrecognized arguments: "):
            return ""
        flags = [word.split("=")[0] for word in message.split(": ", 1)[1].split() if word.startswith("--")]
        takes = self._flags()
        for flag in flags:
            if flag in takes:  # (another subcommand's)
                return f" ({flag} is a flag of {' and '.join(takes[flag])})"
            found = did_you_mean(flag, takes)
            if found:
                return found
        return ""

    def _flags(self):
        """Every long flag of this parser's subcommands, and which subcommands take it (the leftovers of a
        subcommand's flags are reported by the top parser)."""
        takes = {}
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, parser in action.choices.items():
                    for flag in parser._option_string_actions:
                        if flag.startswith("--"):
                            takes.setdefault(flag, []).append(name)
        return takes

    def _print_message(self, message, file=None):
        if MPI.COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)


def build_parser():
    """The parser of ``python -m mpidist``: ``--version``, and a parser of each subcommand, in the order
    ``--help`` lists them."""
    from ..settings.sources import add_flags

    parser = _Parser(
        prog="python -m mpidist",
        description="Train neural networks on many processes with MPI. "
        "Run under `mpiexec -n N`; with no subcommand, `train` runs with its defaults.",
    )
    parser.add_argument("--version", action="version", version=f"mpidist {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    train = sub.add_parser(
        "train",
        help="train a model (the default)",
        description="Train a model (from the zoo, or a builder function of your own) on a "
        "dataset in the mpidist HDF5 layout.",
    )
    add_flags(train)
    _add_eval_parser(sub)
    _add_predict_parser(sub)
    _add_ingest_parser(sub)
    _add_plot_parser(sub)
    _add_info_parser(sub)
    add_bench_parser(sub)
    add_plan_parser(sub)
    return parser


def parse(argv):
    """Parsed arguments; no subcommand means ``train``.  Every value given must be UTF-8 text (see
    :func:`mpidist.runtime.text.check_utf8`): a path that is not is refused here, before anything is made."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["train"] + argv
    parser = build_parser()
    args = parser.parse_args(argv)
    command = next(action for action in parser._actions if action.dest == "command").choices[args.command]
    for action in command._actions:
        values = getattr(args, action.dest, None)
        for value in values if isinstance(values, list) else [values]:
            check_utf8(
                value,
                action.option_strings[-1]
                if action.option_strings
                else f"{args.command} {action.metavar or action.dest.upper()}",
                absolute=action.dest in PATHS and value not in ("auto", "", action.default),
            )
    return args


def _add_eval_parser(sub):
    """``eval``: a checkpoint scored on a dataset's test split."""
    evaluate = sub.add_parser(
        "eval",
        help="evaluate a checkpoint on a dataset's test split",
        description="Evaluate a checkpoint on a dataset's test split, spread over the ranks.",
    )
    evaluate.add_argument(
        "checkpoint",
        help="checkpoint file (ckpt-*.h5), or a checkpoint directory: its newest, as --resume auto picks it",
    )
    evaluate.add_argument("--data", default=None, help="dataset (default: the one the checkpoint trained on)")
    evaluate.add_argument(
        "--model",
        default=None,
        help="model spec or builder (default: the one the checkpoint "
        "names; its code is imported: evaluate only checkpoints you trust)",
    )
    evaluate.add_argument(
        "--eval-samples",
        type=int,
        default=0,
        metavar="N",
        help="evaluate N rows of the test split, evenly spread, the same every time (default: 0 = all)",
    )
    add_split_flags(evaluate)


def _add_predict_parser(sub):
    """``predict``: a checkpoint's predictions on new samples, written to a file."""
    predict = sub.add_parser(
        "predict",
        help="write a checkpoint's predictions on new samples, in input order",
        description="Apply a checkpoint to samples, each rank its own block of rows, and "
        "write the predictions in input order: class and probabilities (classification) "
        "or values (regression).",
    )
    predict.add_argument(
        "checkpoint",
        help="checkpoint file (ckpt-*.h5), or a checkpoint directory: its newest, as --resume auto picks it",
    )
    predict.add_argument(
        "--data",
        default=None,
        help="a dataset in the mpidist layout (its --split is predicted), "
        "or plain samples: an HDF5 file with a dataset x, a .npy file, a .npz file with an "
        "array x, or a .csv file of rows (as ingest reads them; a label column after the features "
        "is left out; with a header, columns are matched by the names ingest stored) (default: the "
        "dataset the checkpoint trained on)",
    )
    predict.add_argument(
        "--split",
        choices=("train", "test", "val"),
        default="test",
        help="the split of a dataset to predict; val where the file has one (default: test)",
    )
    predict.add_argument(
        "--output",
        required=True,
        help="file for the predictions, by its suffix: .csv (class, "
        "name, probabilities; or values), .npy (classes, or values), else HDF5 (an existing one "
        "is replaced once the new one is whole)",
    )
    predict.add_argument(
        "--model",
        default=None,
        help="model spec or builder (default: the one the checkpoint "
        "names; its code is imported: use only checkpoints you trust)",
    )
    add_split_flags(predict)


def add_split_flags(parser):
    """``--stages``, ``--tensor`` and ``--shard`` of ``eval`` and ``predict``: the model split as training
    splits it."""
    parser.add_argument(
        "--stages",
        type=int,
        default=1,
        metavar="S",
        help="split the model into S pipeline stages, as training does, for a model no rank can "
        "hold: each rank reads only its part of the checkpoint (S x T divides the ranks; "
        "default: 1, every rank loads the whole model)",
    )
    parser.add_argument(
        "--tensor",
        type=int,
        default=1,
        metavar="T",
        help="split each stage's layers into T tensor parts, as training does (default: 1)",
    )
    parser.add_argument(
        "--shard",
        choices=("none", "parameters"),
        default="none",
        help="'parameters': each rank holds 1/R of every unit of the model (R: the ranks over T) and "
        "gathers a unit at a time as it runs, as training with --shard parameters does (default: none)",
    )


def _add_ingest_parser(sub):
    """``ingest``: a dataset in the mpidist HDF5 layout, from a file or a named source."""
    from .sources import SOURCES

    ingest = sub.add_parser(
        "ingest",
        help="write a dataset in the mpidist HDF5 layout",
        description="Write a dataset in the mpidist HDF5 layout from a .npz or .csv file "
        f"or a named source ({', '.join(SOURCES)}).",
    )
    ingest.add_argument(
        "source",
        help=f".npz file, .csv file, one of: {', '.join(SOURCES)}; or "
        "synthetic:ROWS,FEATURES,CLASSES (generated Gaussian classes, written a block at a time: "
        "large test data)",
    )
    ingest.add_argument(
        "output", help="HDF5 file to write (replaced atomically), or with --shard-size a new directory"
    )
    ingest.add_argument(
        "--name", default=None, help="dataset name stored in the file (default: from the source)"
    )
    ingest.add_argument(
        "--test-fraction",
        type=float,
        default=None,
        help="share of samples held out as test when the source has no split (default: 0.2); "
        "refused where it has one",
    )
    ingest.add_argument("--seed", type=int, default=0, help="seed of the shuffle and split (default: 0)")
    ingest.add_argument(
        "--task",
        choices=("auto", "classification", "regression"),
        default="auto",
        help="auto: non-negative integer labels, or class names, mean classification (default: auto)",
    )
    ingest.add_argument(
        "--label-column",
        type=int,
        default=-1,
        help="CSV column holding the label: numbers, or "
        "class names (text, mapped to 0..K-1 in sorted order) (default: -1)",
    )
    ingest.add_argument(
        "--delimiter",
        choices=("auto", ",", ";", "tab", "whitespace"),
        default="auto",
        metavar="DELIMITER",
        help="what separates the cells of a CSV file: ',', ';', tab or "
        "whitespace; auto: detected from its first lines, and reported (default: auto)",
    )
    ingest.add_argument(
        "--shard-size",
        type=int,
        default=None,
        metavar="N",
        help="write OUTPUT as a directory of files of N training rows each (test rows spread over "
        "them), read by --data as one dataset",
    )
    ingest.add_argument(
        "--compression",
        choices=("gzip", "lzf", "none"),
        default="gzip",
        help="how x and y are stored: gzip (level 4), lzf (faster), none (fastest to stream; read "
        "without h5py's GIL) (default: gzip)",
    )
    ingest.add_argument(
        "--standardize",
        action="store_true",
        help="store each feature's mean and standard "
        "deviation over the training rows; train, eval and predict then read (x - mean) / std",
    )


def _add_plot_parser(sub):
    """``plot``: PNG figures of runs, or of a plan."""
    plot = sub.add_parser(
        "plot",
        help="draw PNG figures of runs (loss, evaluations, throughput, timeline) or of a plan",
        description="Draw the training loss and the evaluations against step and "
        "time, and the throughput over time, of one or more run directories on one set of axes; "
        "for a run with --trace, a few steps of every rank's timeline. With --plan, draw plan's "
        "predicted samples/s against nodes instead, one line per layout, the runs given as "
        "measured points on top. Needs the plot extra (matplotlib).",
    )
    plot.add_argument("runs", nargs="*", metavar="RUN_DIR", help="run directories (or metrics.jsonl files)")
    plot.add_argument(
        "--plan",
        default=None,
        metavar="PLAN_JSON",
        help="a file written by plan --output: draw plan.png (the runs as measured points)",
    )
    plot.add_argument(
        "--output",
        default=None,
        help="directory for the PNG files (default: the first run's plots/; "
        "with --plan, the plan file's directory)",
    )


def _add_info_parser(sub):
    """``info``: what mpidist sees of MPI, the devices and the ranks."""
    info = sub.add_parser(
        "info",
        help="show the MPI library, devices, ranks per node, models and datasets",
        description="Show what mpidist sees: MPI library, thread level, CUDA-awareness, "
        "ranks per node, devices, models and bundled datasets.",
    )
    info.add_argument("--models", action="store_true", help="only list the model zoo")
