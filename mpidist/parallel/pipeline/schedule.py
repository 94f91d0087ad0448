"""Pipeline schedules as pure functions: each stage's ordered list of actions.

An action is ``(op, micro_batch)`` with ``op`` one of ``recv_fwd``, ``fwd``,
``send_fwd`` (activations, to the next stage), ``recv_bwd``, ``bwd``,
``send_bwd`` (gradients, to the previous stage).  The first stage receives no
activations, the last sends none and starts its backward from the loss.

* ``gpipe``: all forwards, then all backwards (each stage holds all M
  micro-batches' activations at its peak).
* ``1f1b``: stage ``s`` warms up with ``P - s - 1`` forwards, then alternates
  one forward and one backward, then cools down with the remaining backwards
  (at most ``P - s`` micro-batches in flight: never more than P).

Both leave ``(P - 1) / (M + P - 1)`` of each stage's time idle (the bubble)
when every forward and backward takes the same time.  :func:`simulate` runs
all stages' actions against each other as MPI would (sends buffered,
receives waiting for their message) and reports deadlock, peak activations
held and the timeline :func:`render` draws.
"""

SCHEDULES = ("gpipe", "1f1b")


def _forward(stage, stages, micro):
    actions = [] if stage == 0 else [("recv_fwd", micro)]
    actions.append(("fwd", micro))
    return actions + ([] if stage == stages - 1 else [("send_fwd", micro)])


def _backward(stage, stages, micro):
    actions = [] if stage == stages - 1 else [("recv_bwd", micro)]
    actions.append(("bwd", micro))
    return actions + ([] if stage == 0 else [("send_bwd", micro)])


def gpipe(stage, stages, micro_batches):
    """All forwards, then all backwards."""
    actions = []
    for micro in range(micro_batches):
        actions += _forward(stage, stages, micro)
    for micro in range(micro_batches):
        actions += _backward(stage, stages, micro)
    return actions


def one_f_one_b(stage, stages, micro_batches):
    """Warm-up forwards, then one forward one backward, then the remaining backwards."""
    warm = min(stages - stage - 1, micro_batches)
    actions = []
    for micro in range(warm):
        actions += _forward(stage, stages, micro)
    for index in range(micro_batches - warm):
        actions += _forward(stage, stages, warm + index)
        actions += _backward(stage, stages, index)
    for micro in range(micro_batches - warm, micro_batches):
        actions += _backward(stage, stages, micro)
    return actions


def schedule(name, stage, stages, micro_batches):
    """The actions of ``stage`` (of ``stages``) for ``micro_batches`` under schedule ``name``."""
    if name == "gpipe":
        return gpipe(stage, stages, micro_batches)
    if name == "1f1b":
        return one_f_one_b(stage, stages, micro_batches)
    raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")


class Deadlock(RuntimeError):
    """No stage can move: every one waits for a message nobody will send."""


def simulate(plans, cost=None, transfer=0):
    """Run every stage's actions against the others; unit time per forward and backward, or ``cost(stage,
    op)`` seconds (``op`` is ``"fwd"`` or ``"bwd"``), each message arriving ``transfer`` after it was sent.

    Sends are buffered (mpidist posts them non-blocking); a receive waits until
    its message was sent and the sender's compute finished.

    Returns:
        ``(timeline, peak)``: per stage, a list of ``(start, op, micro)`` for
        its computations; per stage, the most micro-batches whose forward was
        done and backward not yet (activations held).

    Raises:
        Deadlock: the stages block each other.
    """
    stages = len(plans)
    position = [0] * stages
    clock = [0] * stages  # when each stage is next free
    sent = {}  # (src, dst, op, micro) -> time the message is ready
    timeline = [[] for _ in range(stages)]
    held, peak = [0] * stages, [0] * stages
    while any(position[s] < len(plans[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while position[s] < len(plans[s]):
                op, micro = plans[s][position[s]]
                if op in ("fwd", "bwd"):
                    timeline[s].append((clock[s], op, micro))
                    clock[s] += 1 if cost is None else cost(s, op)
                    held[s] += 1 if op == "fwd" else -1
                    peak[s] = max(peak[s], held[s])
                elif op == "send_fwd":
                    sent[(s, s + 1, "fwd", micro)] = clock[s] + transfer
                elif op == "send_bwd":
                    sent[(s, s - 1, "bwd", micro)] = clock[s] + transfer
                else:
                    source = s - 1 if op == "recv_fwd" else s + 1
                    key = (source, s, op[5:], micro)
                    if key not in sent:
                        break  # wait for that stage
                    clock[s] = max(clock[s], sent.pop(key))
                position[s] += 1
                moved = True
        if not moved:
            waiting = {s: plans[s][position[s]] for s in range(stages) if position[s] < len(plans[s])}
            raise Deadlock(f"stages wait forever: {waiting}")
    return timeline, peak


def bubble(stages, micro_batches):
    """Theoretical idle fraction of each stage: ``(P - 1) / (M + P - 1)``."""
    return (stages - 1) / (micro_batches + stages - 1)


def render(name, stages, micro_batches):
    """Text picture of the schedule: one row per stage, ``F3``/``B3`` per time unit."""
    timeline, _ = simulate([schedule(name, s, stages, micro_batches) for s in range(stages)])
    end = max(start for row in timeline for start, _, _ in row) + 1
    width = len(str(micro_batches - 1)) + 1
    lines = []
    for s, row in enumerate(timeline):
        cells = ["." * width] * end
        for start, op, micro in row:
            cells[start] = f"{'F' if op == 'fwd' else 'B'}{micro}".ljust(width)
        lines.append(f"stage {s}  " + " ".join(cells))
    return "\n".join(lines)
