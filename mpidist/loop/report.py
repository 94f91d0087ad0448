"""The end of a run in words and figures: the ``done``, ``stopped`` or ``failed`` event and the terminal's
lines."""

import dataclasses
import sys

from ..nn import scores
from ..runtime.cluster import PS
from ..runtime.errors import error_line
from ..runtime.price import said
from ..runtime.preempt import signal_name
from ..store import rundir
from .evaluations import LARGE_EVALUATION
from .metrics import format_summary
from .setup import layout_text


def header(
    config, cluster, setup, outputs, table, asked_seed, held, imbalance=None, watched=True, cores=None
):
    """Chief: what runs where (``table``), and every note of the set-up; the ``start`` event.

    ``held``: ``(rank, what its strategy holds (a dict, where it reports it), its price)`` of every rank
    (:mod:`mpidist.loop.pricing`);
    ``imbalance``: of the ps shards, where there are; ``watched``: the stall
    monitor runs (else a ``--stall-timeout`` goes undiagnosed, which is said); ``cores``: the cores the
    chief's node gives its ranks (the ``start`` event's ``cores_per_node``).
    """
    resume, say = setup.resume, outputs.say
    sizes, limited = setup.info.sizes, setup.info.limited
    prices = [price for _, _, price in held]
    largest = max(range(len(held)), key=prices.__getitem__)
    held = [{"rank": rank, **bytes_} for rank, bytes_, _ in held if bytes_]

    def rows(split):  # (what an evaluation takes, and of how many where --eval-samples cut it)
        return f"{sizes[split]}" + (f" of {limited[split]}" if split in limited else "") + f" {split}"

    val = f" / {rows('val')}" if "val" in sizes else ""  # (a file's own, or --val-fraction's)
    say(
        f"mpidist: {setup.info.name} ({sizes['train']} train{val} / {rows('test')}), "
        f"model {config.model} ({setup.model.num_params:,} parameters), strategy {config.strategy} on "
        f"{layout_text(config, cluster)}, global batch {config.batch_size}, {setup.steps_per_epoch} "
        f"steps/epoch\n{table}"
    )
    if config.precision != "float32":
        scaled = ", the loss scaled dynamically" if config.precision == "fp16" else ""
        say(
            f"mpidist: computing in {config.precision} (parameters, activations, gradients and their "
            f"exchange), float32 master weights and optimizer state{scaled}"
        )
    if imbalance is not None:
        say(f"mpidist: parameter shards balanced to within {100 * imbalance:.2f}%")
    large = [
        split for split in ("val", "test") if sizes.get(split, 0) > LARGE_EVALUATION and split not in limited
    ]
    if large:
        say(
            f"mpidist: note: each evaluation takes every sample of {' and '.join(large)} "
            f"({', '.join(f'{sizes[split]:,}' for split in large)}); --eval-samples N bounds it"
        )
    say(said(prices))
    for path, reason in setup.skipped:
        say(f"mpidist: warning: skipped unreadable checkpoint {path.name}: {reason}")
    for note in setup.notes + outputs.claim.notes:
        say(f"mpidist: {note}")
    if resume is not None:
        say(f"mpidist: resumed from {resume.path} at step {resume.step}")
    if config.stall_timeout and cluster.size > 1 and not watched:
        say(
            "mpidist: warning: --stall-timeout needs MPI_THREAD_MULTIPLE, which this MPI does not give: a "
            "hang will not be diagnosed"
        )
    if asked_seed != config.seed:
        say(
            f"mpidist: note: --seed {asked_seed} ignored: the checkpoint's data order and random streams "
            f"continue with seed {config.seed}"
        )
    outputs.log.write(
        "start",
        config=dataclasses.asdict(config),
        ranks=cluster.size,
        nodes=cluster.num_nodes,
        workers=cluster.num_workers,
        ps=config.ps,
        dataset=setup.info.name,
        params=setup.model.num_params,
        steps_per_epoch=setup.steps_per_epoch,
        resumed_from=None if resume is None else str(resume.path),
        step=0 if resume is None else resume.step,
        evaluated={split: sizes[split] for split in ("val", "test") if split in sizes},
        **({"held_bytes": held} if held else {}),
        memory={"needed": prices, "largest": prices[largest]},
        **({"cores_per_node": cores} if cores else {}),
    )


class Report:
    """The chief's last words on a run (``failed`` is reported by every rank's return value, said by the
    chief).

    Args:
        config, cluster, setup: the run's settings, its ranks and its set-up (dataset, model).
        outputs: the run's :class:`~mpidist.loop.outputs.Outputs`.
        checkpointer: the run's :class:`~mpidist.loop.checkpointer.Checkpointer` (what it wrote).
        position: where the run ended (:class:`~mpidist.loop.position.Position`).
    """

    def __init__(self, config, cluster, setup, outputs, checkpointer, position):
        self.config, self.cluster, self.setup = config, cluster, setup
        self.outputs, self.checkpointer, self.position = outputs, checkpointer, position

    def done(self, window, evaluations, roles, elapsed, clipped=None, stopped_early=False, recoveries=None):
        """The ``done`` event and the summary; returns the final figures.

        ``roles``: every rank's ``(rank, role, stats, peak memory)``; ``elapsed``: seconds of training;
        ``clipped``: the run's clipped steps (None without ``--clip-norm``); ``recoveries``: an elastic run's
        recoveries (None without ``--elastic``)."""
        config, cluster, setup, log = self.config, self.cluster, self.setup, self.outputs.log
        step = self.position.step
        # the scalar test figures first; the per-class ones and the confusion matrix (long) last
        headline = scores.headline(evaluations.test)
        names = getattr(setup.info, "class_names", None)
        detail = {
            name: value
            for name, value in scores.report(evaluations.test, names).items()
            if name not in headline
        }
        samples_per_s = window.trained * config.batch_size / elapsed if elapsed > 0 else 0.0
        # (resumed or recovered at the end: past the last)
        epochs = min(self.position.epoch + 1, config.epochs)
        best = evaluations.best
        final = {
            "steps": step,
            "epochs": epochs,
            "loss": window.last_loss,
            **headline,
            "train_time": elapsed,
            "samples_per_s": samples_per_s,
            "workers": cluster.num_workers,
            "ps": cluster.roles.count(PS),  # (as the run ended: after a lost ps, those left)
            "strategy": config.strategy,
            **({"clipped_steps": clipped} if clipped is not None else {}),
            **(scores.headline(evaluations.val, prefix="val_") if evaluations.val else {}),
            **(
                {
                    "best": {
                        "figure": config.keep_best,
                        "value": best.value,
                        "step": best.step,
                        "path": str(self.checkpointer.best) if self.checkpointer.best else None,
                    }
                }
                if config.keep_best
                else {}
            ),
            **({"stopped_early": True} if stopped_early else {}),
            **({"recoveries": recoveries} if recoveries is not None else {}),
            "peak_rss_mib": max(peak for *_, peak in roles) / (1 << 20),
            "roles": [{"rank": rank, "role": role, **stats} for rank, role, stats, _ in roles if stats],
            **detail,
        }
        log.write("done", **final)
        log.close()
        rows = [
            ("dataset", f"{setup.info.name} ({setup.info.path})"),
            ("model", config.model),
            ("strategy", f"{config.strategy} on {layout_text(config, cluster)}"),
            ("steps", f"{step} ({final['epochs']} epochs)"),
            ("final train loss", f"{window.last_loss:.4f}"),
            *scores.summary_rows(evaluations.test),
            ("training time", f"{elapsed:.2f} s"),
            ("throughput", f"{samples_per_s:,.0f} samples/s"),
            ("peak memory", f"{final['peak_rss_mib']:,.0f} MiB (resident, the largest rank)"),
        ]
        if config.run_dir:
            rows.append(("run directory", config.run_dir))
        if config.metrics:
            rows.append(("metrics", config.metrics))
        if self.outputs.trace_path is not None:
            rows.append(("trace", f"{self.outputs.trace_path} (ui.perfetto.dev, chrome://tracing)"))
        if self.outputs.board is not None:
            logdir = self.outputs.board.logdir
            rows.append(("tensorboard", f"{logdir} (tensorboard --logdir {logdir})"))
        if config.checkpoint_dir:
            rows.append(("checkpoints", config.checkpoint_dir))
        self.outputs.say("mpidist: done\n" + format_summary(rows))
        return final

    def stopped(self, flags):
        """Chief: say which signal stopped the run, and where to resume from."""
        name, config, position, last = (
            signal_name(flags["signal"]),
            self.config,
            self.position,
            self.checkpointer.last,
        )
        self.outputs.log.write(
            "stopped",
            step=position.step,
            epoch=position.epoch + 1,
            signal=name,
            rank=flags["rank"] - 1,
            checkpoint=None if last is None else str(last),
        )
        self.outputs.log.close()
        if last is not None:
            where = f"checkpoint {last} written; continue with {rundir.resume_flags(config)}"
        else:
            where = "no checkpoint written (no --checkpoint-dir): the work done is lost"
        self.outputs.say(
            f"mpidist: stopped by {name} (rank {flags['rank'] - 1}) at step {position.step}: {where}"
        )
        return {"steps": position.step, "epochs": position.epoch + 1, "stopped_by": name, "checkpoint": last}

    def failed(self, reason):
        """Every rank: the run failed at the same point everywhere; the chief says why (exit code 1)."""
        position, checkpointer = self.position, self.checkpointer
        if self.cluster.is_chief:
            self.outputs.log.write("failed", step=position.step, epoch=position.epoch + 1, reason=reason)
            self.outputs.log.close()
            kept = (
                f"; checkpoints already written are kept in {self.config.checkpoint_dir}"
                if self.config.checkpoint_dir
                else ""
            )
            if checkpointer.last is not None and checkpointer.last_step == position.step:
                kept = (
                    f"; checkpoint {checkpointer.last} written at step {position.step}: continue with "
                    f"{rundir.resume_flags(self.config)}"
                )
            sys.stderr.write(error_line(reason + kept) + "\n")
            sys.stderr.flush()
        return {"steps": position.step, "failed": reason}
