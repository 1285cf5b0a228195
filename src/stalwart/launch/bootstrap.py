"""What a Python worker runs first: ``python -u -m stalwart.launch.bootstrap [-m] TARGET ARGS``.

It makes the worker observable, then runs the user's script or module exactly as
``python -u TARGET ARGS`` would (``__name__ == "__main__"``, ``sys.argv``, ``sys.path[0]``):

* the parent-death signal, so a worker never outlives a SIGKILLed launcher;
* ``faulthandler`` on SIGUSR1, so the hang monitor can ask for every thread's stack;
* an uncaught exception is written to ``TORCHELASTIC_ERROR_FILE`` (torchrun's format)
  even when the script has no ``@record``.

Warm workers forked from the template (``zygote.py``) run the same ``run_target``.
It imports only the standard library and ``stalwart.launch.errors``.
"""

from __future__ import annotations

import os
import runpy
import sys

from stalwart.monitor import stacks


def observe() -> None:
    """Hooks every worker gets, cold or warm."""
    # To the rank's stacks.log when the launcher names one, so that several hung ranks'
    # dumps never interleave on the console.
    stacks.install()


def run_target(args: list[str]) -> None:
    """Runs ``[-m] TARGET ARGS`` as ``python -u`` would; raises what the target raises."""
    as_module = bool(args) and args[0] == "-m"
    if as_module:
        args = args[1:]
    if not args:
        print("usage: python -m stalwart.launch.bootstrap [-m] TARGET [ARGS...]", file=sys.stderr)
        sys.exit(2)
    from stalwart.launch.errors import write_error_file

    target = args[0]
    sys.argv = [target, *args[1:]]
    try:
        if as_module:
            # -m semantics: sys.path[0] is the working directory.
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            write_error_file(exc)
        raise
    except BaseException as exc:
        _drop_own_frames(exc)
        write_error_file(exc)
        raise


def _drop_own_frames(exc: BaseException) -> None:
    """The user's traceback should start at their script, not at this bootstrap."""
    here = {__file__, os.path.join(os.path.dirname(__file__), "zygote.py")}
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        name = tb.tb_frame.f_code.co_filename
        if name not in here and "runpy" not in name:
            break
        tb = tb.tb_next
    exc.__traceback__ = tb


def main() -> None:
    parent = os.environ.get("STALWART_LAUNCHER_PID")
    if parent:
        from stalwart.launch.posix import pdeathsig_then_check

        pdeathsig_then_check(int(parent))
    observe()
    run_target(sys.argv[1:])


if __name__ == "__main__":
    main()
