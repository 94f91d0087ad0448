"""Subcommands: ``train`` (the default), ``eval``, ``predict``, ``ingest``, ``info``, ``bench``, ``plan``.

Every rank parses the same command line; errors are agreed on (see
:mod:`mpidist.runtime.errors`) so one message is printed and every rank exits 2.
Only world rank 0 prints help and usage text.
"""

import argparse
import sys

from mpi4py import MPI

from .. import __version__
from ..nn.scores import digits4
from ..runtime.agreement import agreed
from ..runtime.errors import EXIT_OK, UsageError
from ..runtime.preempt import interrupt_on_signals
from ..runtime.text import check_utf8

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
#: ``eval`` prints a per-class table up to this many classes.
PER_CLASS_SHOWN = 100


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, prints on rank 0 only, and takes no abbreviations.

    Abbreviations are off because a job script that says ``--epoch`` would
    silently change meaning the day a second flag starting with it is added.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(f"{message} (see `{self.prog} --help`)")

    def _print_message(self, message, file=None):
        if MPI.COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)


def build_parser():
    from ..settings.sources import add_flags
    from .sources import SOURCES

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

    evaluate = sub.add_parser(
        "eval",
        help="evaluate a checkpoint on a dataset's test split",
        description="Evaluate a checkpoint on a dataset's test split, spread over the ranks.",
    )
    evaluate.add_argument("checkpoint", help="checkpoint file (ckpt-*.h5)")
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

    predict = sub.add_parser(
        "predict",
        help="write a checkpoint's predictions on new samples, in input order",
        description="Apply a checkpoint to samples, each rank its own block of rows, and "
        "write the predictions in input order: class and probabilities (classification) "
        "or values (regression).",
    )
    predict.add_argument("checkpoint", help="checkpoint file (ckpt-*.h5)")
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

    info = sub.add_parser(
        "info",
        help="show the MPI library, devices, ranks per node, models and datasets",
        description="Show what mpidist sees: MPI library, thread level, CUDA-awareness, "
        "ranks per node, devices, models and bundled datasets.",
    )
    info.add_argument("--models", action="store_true", help="only list the model zoo")

    bench = sub.add_parser(
        "bench",
        help="measure throughput and exchange overhead",
        description="Benchmarks printed as a table and saved as JSON. Run under mpiexec; "
        "rows for the single-process baseline run on rank 0 while the others wait.",
    )
    bench.add_argument(
        "--output", default="bench.json", help="JSON file for the results (default: bench.json)"
    )
    bench.add_argument("--seconds", type=float, default=3.0, help="time per measurement (default: 3)")
    bench.add_argument(
        "--models", default="mlp,mlp-wide,cnn", help="comma-separated zoo models (default: mlp,mlp-wide,cnn)"
    )
    bench.add_argument(
        "--batch-per-rank", type=int, default=128, help="samples per rank per step (default: 128)"
    )
    bench.add_argument(
        "--optimizer",
        choices=("sgd", "adam"),
        default="sgd",
        help="what mpidist's rows train with (default: sgd, with momentum, as the hand-written loop "
        "and torch do; with adam, train's default, their rows are left out)",
    )
    bench.add_argument(
        "--streaming",
        default=None,
        metavar="DATA",
        help="instead: train an epoch of DATA (a dataset, e.g. one `ingest synthetic:...` wrote) "
        "held in memory, then streamed with a cold page cache, in interleaved rounds; the first "
        "of --models is trained",
    )
    bench.add_argument(
        "--tracing",
        default=None,
        metavar="DATA",
        help="instead: train DATA without and with --trace, in interleaved rounds (--steps each, "
        "default 600); the first of --models is trained",
    )
    bench.add_argument(
        "--checkpoints",
        default=None,
        metavar="DATA",
        help="instead: train DATA without checkpoints and with one every step (written behind "
        "training), in interleaved rounds (--steps each, default 600); the first of --models is trained",
    )
    bench.add_argument(
        "--settle",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --streaming: idle seconds before each run (default: 15), so that memory the run "
        "before freed, which a VM may be handing back to its host, costs the next run nothing",
    )
    bench.add_argument(
        "--steps",
        type=int,
        default=0,
        help="with --streaming: steps per run in place of a whole epoch (default: 0 = an epoch); "
        "with --tracing and --checkpoints: steps per run (default: 0 = 600)",
    )
    plan = sub.add_parser(
        "plan",
        help="predict speed and memory of every layout on N nodes, from a calibration",
        description="Predict each strategy's samples/s, scaling efficiency and memory per rank "
        "at the node counts asked, and recommend the fastest layout that fits. First measure "
        "the model and the links where it will run: mpiexec -n 2 python -m mpidist plan "
        "--calibrate --model M --data D (two ranks on one node, or one on each of two nodes "
        "to measure the network too).",
    )
    plan.add_argument(
        "--calibrate",
        action="store_true",
        help="measure --model on --data here (under the launcher) and write --calibration",
    )
    plan.add_argument(
        "--calibration",
        default="calibration.json",
        help="the calibration file to write or read (default: calibration.json)",
    )
    plan.add_argument(
        "--model", default="mlp", help="with --calibrate: the model, as train's --model (default: mlp)"
    )
    plan.add_argument(
        "--data", default="digits", help="with --calibrate: the dataset, as train's --data (default: digits)"
    )
    plan.add_argument(
        "--optimizer",
        choices=("adam", "sgd"),
        default="adam",
        help="with --calibrate: the optimizer (default: adam)",
    )
    plan.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default="float32",
        help="with --calibrate: the parameters' type (default: float32)",
    )
    plan.add_argument(
        "--batch-per-rank",
        type=int,
        default=0,
        help="samples a rank trains a step (default: 64 to calibrate; the calibration's to predict)",
    )
    plan.add_argument(
        "--seconds", type=float, default=1.0, help="with --calibrate: time per measurement (default: 1)"
    )
    plan.add_argument("--nodes", default="1,2,4,8", help="node counts to predict (default: 1,2,4,8)")
    plan.add_argument(
        "--ranks-per-node",
        type=int,
        default=0,
        help="ranks per node (default: as many as the calibration ran on one node)",
    )
    plan.add_argument(
        "--link",
        default=None,
        metavar="BANDWIDTH,LATENCY",
        help="the network between nodes, e.g. 25GB/s,2us, in place of the calibration's",
    )
    plan.add_argument(
        "--memory-per-node",
        default=None,
        metavar="SIZE",
        help="memory a node gives a run, e.g. 256G (default: what the calibrated node had free)",
    )
    plan.add_argument(
        "--check",
        nargs="+",
        default=None,
        metavar="RUN_DIR",
        help="instead: the prediction for each finished run beside what it measured",
    )
    plan.add_argument("--output", default="plan.json", help="JSON file for the results (default: plan.json)")
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


def cmd_train(args, world):
    from ..api import train
    from ..settings.sources import settings_from_args

    with agreed(world):
        settings = settings_from_args(args)
    return train(settings=settings, comm=world).exit_code


def cmd_eval(args, world):
    from ..api import evaluate

    figures = evaluate(
        args.checkpoint,
        data=args.data,
        model=args.model,
        comm=world,
        samples=args.eval_samples,
        stages=args.stages,
        tensor=args.tensor,
    )
    if world.Get_rank() == 0:
        print(eval_text(args.checkpoint, figures))
    return EXIT_OK


def eval_text(checkpoint, figures):
    """What ``eval`` prints of :func:`mpidist.evaluate`'s ``figures``: one line, then the per-class table."""
    if "test_accuracy" in figures:
        shown = f"test loss {figures['test_loss']:.4f}, test accuracy {100 * figures['test_accuracy']:.2f}%"
        shown += "".join(
            f", top-{name[len('test_top') : -len('_accuracy')]} accuracy {100 * value:.2f}%"
            for name, value in figures.items()
            if name.startswith("test_top")
        )
    else:
        shown = (
            f"test loss {digits4(figures['test_loss'])}, test MSE {digits4(figures['test_mse'])}, "
            f"MAE {digits4(figures['test_mae'])}, R^2 {figures['test_r2']:.4f}"
        )
    lines = [
        f"mpidist eval: {checkpoint} (step {figures['step']}, model {figures['model']}) on "
        f"{figures['dataset']!r}: {shown} over {figures['samples']} samples"
    ]
    per_class = figures.get("test_per_class") or []
    if per_class and len(per_class) <= PER_CLASS_SHOWN:
        width = max([5] + [len(str(record.get("name", record["class"]))) for record in per_class])
        lines.append(f"  {'class':<{width}}  precision  recall      f1  support")
        lines += [
            f"  {str(record.get('name', record['class'])):<{width}}  {record['precision']:>9.4f}  "
            f"{record['recall']:>6.4f}  {record['f1']:>6.4f}  {record['support']:>7}"
            for record in per_class
        ]
    elif per_class:
        lines.append(f"  (per-class figures of {len(per_class)} classes: mpidist.evaluate() returns them)")
    return "\n".join(lines)


def add_split_flags(parser):
    """``--stages`` and ``--tensor`` of ``eval`` and ``predict``: the model split as training splits it."""
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


def cmd_predict(args, world):
    from .predictions import predict

    result = predict(
        args.checkpoint,
        data=args.data,
        output=args.output,
        model=args.model,
        comm=world,
        split=args.split,
        stages=args.stages,
        tensor=args.tensor,
    )
    if world.Get_rank() == 0:
        print(result.summary())
    return EXIT_OK


def cmd_ingest(args, world):
    from .ingest import ingest

    with agreed(world):
        if world.Get_rank() == 0:
            written = ingest(
                args.source,
                args.output,
                name=args.name,
                test_fraction=args.test_fraction,
                seed=args.seed,
                task=args.task,
                label_column=args.label_column,
                standardize=args.standardize,
                delimiter=args.delimiter,
                shard_size=args.shard_size,
                compression=args.compression,
            )
            print(written.summary())
    return EXIT_OK


def cmd_plot(args, world):
    from .plan_figure import main as plot_plan
    from .plotting import main as plot

    notes = []
    with agreed(world):
        if world.Get_rank() != 0:
            written = []
        elif args.plan is not None:
            written, notes = plot_plan(args.plan, args.runs, args.output)
        elif not args.runs:
            raise UsageError("plot: give run directories to draw, or --plan PLAN_JSON")
        else:
            written = plot(args.runs, args.output)
    for note in notes:
        print(f"mpidist plot: {note}")
    for path in written:
        print(f"mpidist plot: wrote {path}")
    return 0


def cmd_info(args, world):
    from .info import report

    text = report(world, models_only=args.models)
    if text:
        print(text)
    return EXIT_OK


def cmd_bench(args, world):
    from ..bench import run_bench

    with agreed(world):
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        from ..nn import MODELS

        unknown = [m for m in models if m not in MODELS]
        if unknown:
            raise UsageError(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
        if args.seconds <= 0 or args.batch_per_rank < 1:
            raise UsageError("--seconds must be positive and --batch-per-rank at least 1")
        if args.steps < 0:
            raise UsageError(f"--steps {args.steps}: give 0 (an epoch) or more")
        chosen = [flag for flag in ("streaming", "tracing", "checkpoints") if getattr(args, flag) is not None]
        if len(chosen) > 1:
            count = ("two", "three")[len(chosen) - 2]
            raise UsageError(
                f"{' and '.join('--' + flag for flag in chosen)} are {count} benchmarks: give one"
            )
        if args.settle is not None and (args.streaming is None or not 0 <= args.settle <= 600):
            raise UsageError(f"--settle {args.settle:g}: give 0 to 600 seconds, with --streaming")
    if args.streaming is not None:
        from ..bench import run_streaming_bench

        run_streaming_bench(
            world, args.streaming, models[0], args.batch_per_rank, args.steps, args.output, args.settle
        )
        return EXIT_OK
    if args.tracing is not None:
        from ..bench import run_tracing_bench

        run_tracing_bench(world, args.tracing, models[0], args.batch_per_rank, args.steps, args.output)
        return EXIT_OK
    if args.checkpoints is not None:
        from ..bench import run_checkpoint_bench

        run_checkpoint_bench(world, args.checkpoints, models[0], args.batch_per_rank, args.steps, args.output)
        return EXIT_OK
    run_bench(world, models, args.seconds, args.batch_per_rank, args.output, args.optimizer)
    return EXIT_OK


def cmd_plan(args, world):
    from ..plan import command

    if args.calibrate:
        with agreed(world):
            if args.check is not None:
                raise UsageError("--calibrate and --check: give one")
            if args.seconds <= 0 or args.batch_per_rank < 0:
                raise UsageError("--seconds must be positive and --batch-per-rank at least 1")
            from ..settings.config import Settings

            settings = Settings(
                model=args.model,
                data=args.data,
                optimizer=args.optimizer,
                dtype=args.dtype,
                batch_size=args.batch_per_rank or 64,
            )
            if world.Get_rank() == 0:
                from ..bench.output import check_output

                check_output(args.calibration)
        command.calibrate(world, settings, args.calibration, args.seconds)
        return EXIT_OK
    with agreed(world):
        if world.Get_rank() == 0:
            if args.check is not None:
                command.check(args.calibration, args.check, args.output)
            else:
                if args.ranks_per_node < 0 or args.batch_per_rank < 0:
                    raise UsageError("--ranks-per-node and --batch-per-rank must be at least 1")
                command.plan(
                    args.calibration,
                    args.nodes,
                    args.ranks_per_node,
                    args.batch_per_rank,
                    args.link,
                    args.memory_per_node,
                    args.output,
                )
    return EXIT_OK


def main(argv=None):
    """Entry point of ``python -m mpidist`` (and the ``mpidist`` script)."""
    world = MPI.COMM_WORLD
    for stream in (sys.stdout, sys.stderr):  # a file name that is not UTF-8, found on disk, is shown escaped
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    with agreed(world):
        args = parse(argv)
    handler = {
        "train": cmd_train,
        "eval": cmd_eval,
        "predict": cmd_predict,
        "ingest": cmd_ingest,
        "info": cmd_info,
        "bench": cmd_bench,
        "plot": cmd_plot,
        "plan": cmd_plan,
    }[args.command]
    if args.command == "train":  # training stops at a step boundary, after a checkpoint
        return handler(args, world)
    with (
        interrupt_on_signals()
    ):  # the others end where the signal lands, removing what they were writing (exit 3)
        return handler(args, world)
