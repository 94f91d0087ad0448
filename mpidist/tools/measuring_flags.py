"""The flags of the two subcommands that measure speed: ``bench`` and ``plan``.

``bench`` times training (the rows, and the streaming, tracing and checkpoint
benchmarks) and ``plan`` calibrates a model and its links, then predicts every
layout's speed and memory.  Their 25 flags, each with the help a user reads,
are a concept of their own: kept apart from the rest of the command line's
grammar (:mod:`mpidist.tools.parsing`, which adds them to the parser), so that
neither module grows past the size a module may have.  The checks of their
values across flags are :mod:`mpidist.tools.cli`'s, where the commands run.
"""

from ..runtime.errors import UsageError


#: the most ``--seconds`` a measurement may take (an hour: a longer one is a mistake, and ``inf`` never ends)
MOST_SECONDS = 3600.0


def check_seconds(seconds):
    """Refuse a ``--seconds`` that is not a time a measurement can take: 0 or less, NaN, past an hour."""
    if not 0 < seconds <= MOST_SECONDS:
        raise UsageError(f"--seconds {seconds:g}: give a time above 0 and at most {MOST_SECONDS:g} seconds")


def add_bench_parser(sub):
    """``bench``: throughput and exchange overhead, printed as a table and saved as JSON.

    Args:
        sub: the command line's subparsers (``add_subparsers``'s action).
    """
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
        "--models",
        default="mlp,mlp-wide,cnn,transformer:2,64,4",
        help="comma-separated zoo models, with arguments as train's --model takes them "
        "(default: mlp,mlp-wide,cnn,transformer:2,64,4)",
    )
    bench.add_argument(
        "--tables",
        default=None,
        help="comma-separated tables to measure, of strategies (each strategy against the one-process and "
        "no-exchange references), sharding, pipeline and tensor (default: all four)",
    )
    bench.add_argument(
        "--wide",
        action="store_true",
        help="print every column of the strategies table (bytes a step, inter-node bytes, the exchange's "
        "time against bare MPI's); the default table fits 120 columns, and bench.json holds them all",
    )
    bench.add_argument(
        "--layers",
        action="store_true",
        help="instead: each layer's forward and backward time in a training step, mpidist's beside "
        "torch's (where installed), on one process; for each of --models",
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


def add_plan_parser(sub):
    """``plan``: a calibration measured here, or every layout's predicted speed and memory on N nodes.

    Args:
        sub: the command line's subparsers (``add_subparsers``'s action).
    """
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
