"""``python -m mpidist``: make failures end the whole job, then run the CLI.

Importing :mod:`mpidist` sizes the BLAS thread pools first (see
:mod:`mpidist.runtime.threads`); then the abort hook goes in, before any work that
could fail, so no failure can leave ranks waiting.
"""


def main():
    from .runtime.agreement import install_abort_on_exception

    install_abort_on_exception()
    from .runtime import ulfm
    from .runtime.preempt import stop_signals
    from .tools import cli

    stop_signals().install()  # from here on, a scheduler's SIGTERM stops the run cleanly (exit code 3)

    try:
        code = cli.main()
    except SystemExit as done:
        code = done.code
    if ulfm.failure_seen():  # after a lost rank, MPI_Finalize can hang: end as the survivors agree
        ulfm.exit_after_failure(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
