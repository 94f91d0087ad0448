"""Subcommands: ``train`` (the default), ``eval``, ``predict``, ``ingest``, ``info``, ``bench``, ``plan``.

Every rank parses the same command line (:mod:`mpidist.tools.parsing`); errors
are agreed on (see :mod:`mpidist.runtime.errors`) so one message is printed and
every rank exits 2.  Only world rank 0 prints help and usage text.  This module
is what each subcommand runs once parsed, and :func:`main`, which dispatches to
it.
"""

import sys

from mpi4py import MPI

from ..nn.scores import digits4
from ..runtime.agreement import agreed
from ..runtime.errors import EXIT_OK, UsageError
from ..runtime.preempt import interrupt_on_signals
from .measuring_flags import check_seconds
from .parsing import parse

#: ``eval`` prints a per-class table up to this many classes.
PER_CLASS_SHOWN = 100


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
        shard=args.shard,
    )
    if world.Get_rank() == 0:
        print(eval_text(figures["checkpoint"], figures))
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
        shard=args.shard,
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
            written, notes = plot(args.runs, args.output)
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


def bench_models(text):
    """``--models``' zoo specs: ``mlp,cnn,transformer:2,64,4`` -> ``["mlp", "cnn", "transformer:2,64,4"]``.

    A number continues the arguments of the spec before it (a spec's own
    arguments are comma-separated too).  Raises :class:`UsageError` naming a
    spec the zoo does not build, or where none is given.
    """
    from ..nn import SpecError, parse_spec

    specs = []
    for part in (piece.strip() for piece in text.split(",")):
        if part.isdigit() and specs and ":" in specs[-1]:
            specs[-1] += "," + part
        elif part:
            specs.append(part)
    if not specs:
        raise UsageError(f"--models {text!r}: give one zoo model or more, e.g. mlp,cnn,transformer:2,64,4")
    for spec in specs:
        try:
            parse_spec(spec)
        except SpecError as err:
            raise UsageError(f"--models: {err}") from None
    return specs


def bench_tables(text):
    """``--tables``' names, in the order :data:`~mpidist.bench.TABLES` prints them; all of them where
    ``text`` is None.  Raises :class:`UsageError` naming a table bench does not have."""
    from ..bench import TABLES

    if text is None:
        return list(TABLES)
    names = {piece.strip() for piece in text.split(",")} - {""}
    unknown = sorted(names - set(TABLES))
    if unknown or not names:
        raise UsageError(
            f"--tables {text!r}: {'no table ' + repr(unknown[0]) if unknown else 'give one table or more'}; "
            f"choose from {','.join(TABLES)}"
        )
    return [table for table in TABLES if table in names]


def cmd_bench(args, world):
    from ..bench import run_bench

    with agreed(world):
        models = bench_models(args.models)
        check_seconds(args.seconds)
        if args.batch_per_rank < 1:
            raise UsageError(f"--batch-per-rank {args.batch_per_rank}: give 1 or more")
        if args.steps < 0:
            raise UsageError(f"--steps {args.steps}: give 0 (an epoch) or more")
        chosen = [flag for flag in ("streaming", "tracing", "checkpoints") if getattr(args, flag) is not None]
        chosen += ["layers"] if args.layers else []
        if len(chosen) > 1:
            count = ("two", "three", "four")[len(chosen) - 2]
            raise UsageError(
                f"{' and '.join('--' + flag for flag in chosen)} are {count} benchmarks: give one"
            )
        if args.settle is not None and (args.streaming is None or not 0 <= args.settle <= 600):
            raise UsageError(f"--settle {args.settle:g}: give 0 to 600 seconds, with --streaming")
        if chosen and args.tables is not None:
            raise UsageError(f"--tables picks the tables of the default benchmark, not of --{chosen[0]}")
        if chosen and args.wide:
            raise UsageError(f"--wide widens the default benchmark's strategies table, not --{chosen[0]}'s")
        tables = bench_tables(args.tables)
    if args.layers:
        from ..bench import run_layers_bench

        run_layers_bench(world, models, args.seconds, args.batch_per_rank, args.output)
        return EXIT_OK
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
    run_bench(
        world, models, args.seconds, args.batch_per_rank, args.output, args.optimizer, tables, args.wide
    )
    return EXIT_OK


def cmd_plan(args, world):
    from ..plan import command

    if args.calibrate:
        with agreed(world):
            if args.check is not None:
                raise UsageError("--calibrate and --check: give one")
            check_seconds(args.seconds)
            if args.batch_per_rank < 0:
                raise UsageError(
                    f"--batch-per-rank {args.batch_per_rank}: give 1 or more (0: 64, the default)"
                )
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

                check_output(args.calibration, "--calibration")
        command.calibrate(world, settings, args.calibration, args.seconds)
        return EXIT_OK
    with agreed(world):
        if world.Get_rank() == 0:
            if args.check is not None:
                command.check(args.calibration, args.check, args.output)
            else:
                if args.ranks_per_node < 0 or args.batch_per_rank < 0:
                    raise UsageError(
                        "--ranks-per-node and --batch-per-rank: give 1 or more (0: the calibration's, the "
                        "default)"
                    )
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
    # the others end where the signal lands, removing what they were writing (exit 3)
    with interrupt_on_signals():
        return handler(args, world)
