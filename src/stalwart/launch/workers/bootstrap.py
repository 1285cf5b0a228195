"""What a Python worker runs first: ``python -u -m stalwart.launch.workers.bootstrap [-m] TARGET ARGS``.

It makes the worker observable, then runs the user's script or module exactly as
``python -u TARGET ARGS`` would (``__name__ == "__main__"``, ``sys.argv``, ``sys.path[0]``,
``sys.orig_argv``, the process title ``ps`` and ``pgrep -f`` see, and an uncaught
exception's traceback starting at the user's code):

* the parent-death signal, so a worker never outlives a SIGKILLed launcher;
* torch's optimizer-step hook (``stalwart.autostep``), so each optimizer step is a step
  for the launcher with no change to the program;
* ``faulthandler`` on a real-time signal (``stacks.STACK_SIGNAL``), so the hang monitor can ask for every thread's stack;
* under ``--ckpt-ram``, in a warm worker (whose template imported the checkpoint code),
  a restarted rank's newest shard set in the launcher's memory is verified on a thread
  while the program starts (``stalwart.checkpoint.ramshared``), not at its restore;
* an uncaught exception is written to ``TORCHELASTIC_ERROR_FILE`` (torchrun's format)
  even when the script has no ``@record``;
* a program that failed (an uncaught exception, ``sys.exit`` with a failure code) ends
  through ``exiting``: the shutdown it can see, without the interpreter's teardown.

Warm workers forked from the template (``zygote.py``) run the same ``run_target``.
It imports only the standard library, ``setproctitle``, ``stalwart.launch.workers.errors``
and ``stalwart.launch.workers.exiting``.
"""

from __future__ import annotations

import builtins
import io
import os
import runpy
import sys
import types
import zipimport
from importlib.machinery import SourceFileLoader
from typing import NoReturn

from stalwart import autostep
from stalwart.base import envvars
from stalwart.launch.workers import exiting
from stalwart.monitor import stacks


def observe() -> None:
    """Hooks every worker gets, cold or warm."""
    # To the rank's stacks.log when the launcher names one, so that several hung ranks'
    # dumps never interleave on the console.
    stacks.install()
    # Every optimizer step counts as a training step (off with --no-auto-progress).
    autostep.install()
    precheck_snapshots()


def precheck_snapshots() -> None:
    """Start verifying this rank's newest shard set in the launcher's memory, if any.

    Only where the checkpoint code is already imported (a warm worker: the template
    preloads it with torch): a cold worker would import torch here for it, before its
    program, which may never restore from RAM.
    """
    if "stalwart.checkpoint.ram" not in sys.modules:
        return
    from stalwart.checkpoint import ramshared
    from stalwart.checkpoint.errors import CheckpointError

    try:
        ramshared.precheck_from_env()
    except (OSError, ValueError, CheckpointError) as exc:
        # Only a head start: the restore verifies (and reports) for itself.
        sys.stderr.write(f"stalwart: snapshot pre-check skipped: {exc}\n")


def set_title(argv: list[str]) -> None:
    """Sets what ``ps`` shows as this process's command line."""
    # SPT_NOENV: the title must fit where the command line was and leave the environment
    # block alone (the guardian finds our processes by a variable in it).  A cold worker's
    # bootstrap command line is longer than its title; the launcher gives the template a
    # command line long enough for any worker's title.
    os.environ[envvars.SPT_NOENV] = "1"
    try:
        import setproctitle

        setproctitle.setproctitle(" ".join(argv))
    finally:
        del os.environ[envvars.SPT_NOENV]


def run_target(args: list[str]) -> None:
    """Runs ``[-m] TARGET ARGS`` as ``python -u`` would; raises what the target raises,
    except an uncaught exception, which it reports and exits with as the interpreter would."""
    command = list(args)
    as_module = bool(args) and args[0] == "-m"
    if as_module:
        args = args[1:]
    if not args:
        print(
            "usage: python -m stalwart.launch.workers.bootstrap [-m] TARGET [ARGS...]",
            file=sys.stderr,
        )
        sys.exit(2)
    from stalwart.launch.workers.errors import write_error_file

    target = args[0]
    sys.argv = [target, *args[1:]]
    # What torchrun's worker would have: ``python -u [-m] TARGET ARGS``.
    sys.orig_argv = [sys.executable, "-u", *command]
    set_title(sys.orig_argv)
    try:
        if as_module:
            # -m semantics: sys.path[0] is the working directory.
            sys.path[0] = os.getcwd()
            _fresh_main()
            # What ``python -m`` itself calls: the module runs in ``__main__``'s own
            # namespace, ``sys.argv[0]`` becomes its file, and a missing module is
            # "python: No module named X" with exit 1, as there.
            runpy._run_module_as_main(target, True)  # type: ignore[attr-defined]
        else:
            _run_script(target)
    except SystemExit as exc:
        if exc.code in (None, 0):
            raise
        # The error file's traceback starts at the program, as the uncaught case's does.
        _drop_own_frames(exc)
        write_error_file(exc)
        _exit_failed(exc)
    except BaseException as exc:
        _drop_own_frames(exc)
        write_error_file(exc)
        _exit_uncaught(exc)


def _fresh_main() -> types.ModuleType:
    """Installs the ``__main__`` module a new interpreter starts with (``__builtins__`` the
    module, an empty ``__annotations__``); ours (the bootstrap's, or the template's) must
    not show through to the program, and runpy's stand-in module lacks both."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__annotations__={}, __builtins__=builtins)
    _previous_mains.append(sys.modules["__main__"])
    sys.modules["__main__"] = main
    return main


def _is_zip(path: str) -> bool:
    # How the interpreter tells (zipimport is always loaded: zipfile would import more).
    try:
        zipimport.zipimporter(path)
    except zipimport.ZipImportError:
        return False
    return True


# The modules ``_fresh_main`` replaced: our own code still runs in their namespaces.
_previous_mains: list[types.ModuleType] = []


def _run_script(target: str) -> None:
    """``python SCRIPT``: ``__file__`` and the code's file name are the absolute path,
    ``sys.path[0]`` the folder of the script's real path (symbolic links resolved), the
    loader a ``SourceFileLoader``.  A folder or zip file with ``__main__.py`` goes
    through runpy, as the interpreter's own does."""
    path = os.path.abspath(target)
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    if not os.path.isfile(path) or path.endswith((".pyc", ".pyo")) or _is_zip(path):
        runpy.run_path(target, run_name="__main__")
        return
    main = _fresh_main()
    loader = SourceFileLoader("__main__", path)
    main.__dict__.update(__file__=path, __cached__=None, __loader__=loader)
    with io.open_code(path) as fh:
        source = fh.read()
    code = compile(source, path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _exit_uncaught(exc: BaseException) -> NoReturn:
    """What the interpreter does with an uncaught exception, done here because letting it
    propagate would prepend our frames (and runpy's) to the traceback it prints; then the
    shutdown of ``exiting``, without the interpreter's teardown."""
    tb = exc.__traceback__
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    if sys.version_info >= (3, 12):
        sys.last_exc = exc
    try:
        sys.excepthook(type(exc), exc, tb)
    except BaseException as hook_exc:
        print("Error in sys.excepthook:", file=sys.stderr)
        sys.__excepthook__(type(hook_exc), hook_exc, hook_exc.__traceback__)
        print("\nOriginal exception was:", file=sys.stderr)
        sys.__excepthook__(type(exc), exc, tb)
    # An uncaught KeyboardInterrupt ends the process by SIGINT once it has shut down.
    exiting.shut_down_and_exit(1, interrupted=isinstance(exc, KeyboardInterrupt))


def _exit_failed(exc: SystemExit) -> NoReturn:
    """``sys.exit(code)`` with a code that is not success: what the interpreter prints and
    the status it exits with, after the shutdown of ``exiting``."""
    end = exiting.exit_status(exc.code)
    if end.message is not None:
        try:
            print(end.message, file=sys.stderr)
        except Exception:
            # As the interpreter: no stderr to print to (closed, None) loses the message.
            pass
    exiting.shut_down_and_exit(end.status)


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
    parent = os.environ.get(envvars.LAUNCHER_PID)
    if parent:
        from stalwart.base.procs import pdeathsig_then_check

        pdeathsig_then_check(int(parent))
    observe()
    run_target(sys.argv[1:])


if __name__ == "__main__":
    main()
