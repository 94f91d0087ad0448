"""How long ``bench`` will take, said before it starts: its measuring windows and each table's set-up.

Each figure is measured in windows of ``--seconds`` (the rows of a window
alternate step by step); around them, each table builds its models,
strategies and references, and warms them up.  The set-up costs below were
measured on the 2-core development machine (2 ranks, ``--seconds 1``: the
whole default bench in 108 s, of which 19 s were windows); a busy or slower
machine takes longer, and the estimate says it is one.
"""

import dataclasses

#: seconds of set-up per model of the strategies table, a whole table's otherwise (measured, see above)
SETUP = {"strategies": 18.0, "sharding": 0.3, "pipeline": 2.0, "tensor": 0.5}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a bench run measures: its tables, models, ranks, and whether rank 0 also measures every core."""

    tables: tuple
    models: tuple
    ranks: int
    every_core: bool = False


def windows(plan, table):
    """The measuring windows of ``--seconds`` that ``table`` takes."""
    if table == "strategies":
        per_model = 1 + plan.every_core + 1 + (2 if plan.ranks > 1 else 0)  # one process, allreduce, ps
        return per_model * len(plan.models)
    if table == "pipeline":
        return 2 if plan.ranks > 1 else 0  # (2 schedules x 4 counts, a quarter window each)
    if table == "tensor":
        return 1 if plan.ranks % 2 == 0 else 0
    return 0  # sharding: bytes, counted over two steps


def seconds(plan, table, seconds_each):
    """About how long ``table`` takes at ``--seconds seconds_each``."""
    count, per_model = windows(plan, table), table in ("strategies", "sharding")
    if not (per_model or count):  # (a table these ranks cannot run: pipeline on one, tensor on an odd count)
        return 0
    return count * seconds_each + SETUP[table] * (len(plan.models) if per_model else 1)


def said(plan, seconds_each):
    """The line that says how long the run will take, table by table."""
    parts = [(table, seconds(plan, table, seconds_each)) for table in plan.tables]
    total = sum(part for _, part in parts)
    each = ", ".join(f"{table} {part:.0f} s" for table, part in parts if part)
    return (
        f"mpidist bench: about {_minutes(total)} ({each}; twice that on a busy machine): each row is "
        "printed as its model is measured"
    )


def _minutes(seconds_):
    return f"{seconds_:.0f} s" if seconds_ < 120 else f"{seconds_ / 60:.1f} min"
