"""Prints (to $PROBE_OUT) a JSON fingerprint of everything a training script can observe
about its own process, to compare torchrun, ``stalwart run`` warm and ``--no-warm``.

argv: ``[crash] [children]``.  ``crash``: rank 0 fails attempt 0 once both ranks wrote
(so a restarted attempt is probed too).  ``children``: rank 0 of the last attempt starts DataLoader
workers under fork / spawn / forkserver and ``torch.multiprocessing.spawn``, with a
dataset and a function defined here in ``__main__``.  On its last attempt rank 1 ends
with ``sys.exit(3)`` once rank 0 has ended normally: both must run their atexit handlers.
"""

import atexit
import faulthandler
import gc
import json
import logging
import multiprocessing
import os
import random
import resource
import signal
import sys
import threading
import time
import warnings

MODULES_AT_START = sorted(sys.modules)
THREADS_AT_START = sorted(t.name for t in threading.enumerate())
TASKS_AT_START = len(os.listdir("/proc/self/task"))

OUT = os.environ["PROBE_OUT"]
RANK = int(os.environ["RANK"])
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _write_file(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as fh:
        fh.write(text)
    os.rename(path + ".tmp", path)


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def _read_json(path: str) -> dict[str, object]:
    return dict(json.loads(_read(path)))


def _atexit() -> None:
    _write_file(os.path.join(OUT, f"atexit_{ATTEMPT}_{RANK}"), "ran")


atexit.register(_atexit)


def _handler_name(h: object) -> str:
    if h is signal.SIG_DFL:
        return "SIG_DFL"
    if h is signal.SIG_IGN:
        return "SIG_IGN"
    if h is None:
        return "None (not set from Python)"
    return getattr(h, "__qualname__", repr(h))


def _fds() -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        out[name] = target
    return out


def _status(field: str) -> str:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return line.split(":", 1)[1].strip()
    return ""


def _pdeathsig() -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    sig = ctypes.c_int(0)
    libc.prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
    return sig.value


def _loggers() -> dict[str, object]:
    out: dict[str, object] = {}
    root = logging.getLogger()
    out["<root>"] = [root.level, [type(h).__name__ for h in root.handlers]]
    for name, lg in sorted(logging.Logger.manager.loggerDict.items()):
        if isinstance(lg, logging.Logger) and (lg.handlers or lg.level or not lg.propagate):
            out[name] = [lg.level, [type(h).__name__ for h in lg.handlers], lg.propagate]
    return out


def _stream(s: object) -> dict[str, object]:
    return {
        "type": type(s).__name__,
        "encoding": getattr(s, "encoding", None),
        "errors": getattr(s, "errors", None),
        "line_buffering": getattr(s, "line_buffering", None),
        "write_through": getattr(s, "write_through", None),
        "buffer": type(getattr(s, "buffer", None)).__name__,
        "fileno": s.fileno() if hasattr(s, "fileno") else None,  # type: ignore[attr-defined]
    }


def _parent() -> dict[str, object]:
    import psutil

    me = psutil.Process()
    parent = me.parent()
    cmd = parent.cmdline() if parent is not None else []
    return {
        "ppid_is_1": os.getppid() == 1,
        "parent_cmdline": cmd,
        "parent_is_session_leader": parent is not None and os.getsid(parent.pid) == parent.pid,
    }


# ---- what __main__ defines, for children that find it by reference -------------------
class SquareDataset:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[int, int, str, int]:
        import torch.utils.data as tud

        info = tud.get_worker_info()
        return (
            i * i,
            os.getpid(),
            sys.modules["__main__"].__name__ if "__main__" in sys.modules else "?",
            info.id if info is not None else -1,
        )


def spawned(index: int, out: str) -> None:
    _write_file(
        os.path.join(out, f"mpspawn_{index}"),
        json.dumps({"main": sys.modules["__main__"].__name__, "ppid": os.getppid()}),
    )


def _children() -> dict[str, object]:
    import torch.multiprocessing as tmp
    from torch.utils.data import DataLoader

    out: dict[str, object] = {}
    for method in ("fork", "spawn", "forkserver"):
        try:
            dl = DataLoader(
                SquareDataset(),
                batch_size=None,
                num_workers=2,
                multiprocessing_context=method,
            )
            items = [tuple(x.tolist() if hasattr(x, "tolist") else x for x in b) for b in dl]
            out[f"dataloader_{method}"] = {
                "squares": [int(x[0]) for x in items],
                "workers": sorted({int(x[3]) for x in items}),
                "main_names": sorted({str(x[2]) for x in items}),
            }
        except Exception as exc:  # the difference is the finding
            out[f"dataloader_{method}"] = f"{type(exc).__name__}: {exc}"
    try:
        tmp.spawn(spawned, args=(OUT,), nprocs=2, join=True)
        out["mp_spawn"] = [_read_json(os.path.join(OUT, f"mpspawn_{i}"))["main"] for i in (0, 1)]
    except Exception as exc:
        out["mp_spawn"] = f"{type(exc).__name__}: {exc}"
    return out


def fingerprint() -> dict[str, object]:
    import numpy as np
    import torch

    fp: dict[str, object] = {
        "environ": dict(os.environ),
        "argv": sys.argv,
        "orig_argv": sys.orig_argv,
        "executable": sys.executable,
        "path": sys.path,
        "flags": repr(sys.flags),
        "warnoptions": sys.warnoptions,
        "xoptions": sys._xoptions,
        "file": __file__,
        "name": __name__,
        "spec": repr(__spec__),
        "main_spec": repr(getattr(sys.modules["__main__"], "__spec__", "missing")),
        "main_loader": type(getattr(sys.modules["__main__"], "__loader__", None)).__name__,
        "main_cached": getattr(sys.modules["__main__"], "__cached__", "missing"),
        "main_builtins_is_module": isinstance(sys.modules["__main__"].__builtins__, type(sys)),
        "main_globals": sorted(k for k in globals() if k.startswith("__")),
        "cwd": os.getcwd(),
        "parent": _parent(),
        "pgid_is_pid": os.getpgid(0) == os.getpid(),
        "sid_is_pid": os.getsid(0) == os.getpid(),
        "sid_is_parents": os.getsid(0) == os.getsid(os.getppid()),
        "umask": os.umask(0o022),
        "rlimits": {
            n: resource.getrlimit(getattr(resource, n))
            for n in sorted(dir(resource))
            if n.startswith("RLIMIT_")
        },
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "sched": os.sched_getscheduler(0),
        "affinity": sorted(os.sched_getaffinity(0)),
        "oom_score_adj": _read("/proc/self/oom_score_adj").strip(),
        "pdeathsig": _pdeathsig(),
        "nonewprivs": _status("NoNewPrivs"),
        "sigign": _status("SigIgn"),
        "sigcgt": _status("SigCgt"),
        "sigblk": _status("SigBlk"),
        "handlers": {
            s.name: _handler_name(signal.getsignal(s))
            for s in signal.Signals
            if s not in (signal.SIGKILL, signal.SIGSTOP)
        },
        "sigmask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "threads_at_start": THREADS_AT_START,
        "tasks_at_start": TASKS_AT_START,
        "torch_threads": torch.get_num_threads(),
        "torch_interop": torch.get_num_interop_threads(),
        "torch_deterministic": torch.are_deterministic_algorithms_enabled(),
        "torch_dtype": str(torch.get_default_dtype()),
        "torch_grad": torch.is_grad_enabled(),
        "torch_seed": torch.initial_seed(),
        "torch_rand": torch.rand(2).tolist(),
        "np_rand": np.random.rand(2).tolist(),
        "py_rand": random.random(),
        "hash": hash("stalwart"),
        "loggers": _loggers(),
        "logging_disable": logging.root.manager.disable,
        "warnings_filters": [
            (f[0], str(f[1].pattern) if f[1] else None, f[2].__name__, str(f[3]), f[4])
            for f in warnings.filters
        ],
        "showwarning": warnings.showwarning.__module__,
        "excepthook": sys.excepthook is sys.__excepthook__,
        "threading_excepthook": threading.excepthook is threading.__excepthook__,
        "displayhook": sys.displayhook is sys.__displayhook__,
        "breakpointhook": sys.breakpointhook is sys.__breakpointhook__,
        "unraisablehook": sys.unraisablehook is sys.__unraisablehook__,
        "audit_hooks": "n/a",
        "profile": sys.getprofile() is None and sys.gettrace() is None,
        "recursionlimit": sys.getrecursionlimit(),
        "switchinterval": sys.getswitchinterval(),
        "modules_at_start": MODULES_AT_START,
        "faulthandler": faulthandler.is_enabled(),
        "gc_enabled": gc.isenabled(),
        "gc_threshold": gc.get_threshold(),
        "gc_freeze_count": gc.get_freeze_count(),
        "gc_debug": gc.get_debug(),
        "gc_callbacks": len(gc.callbacks),
        "stdout": _stream(sys.stdout),
        "stderr": _stream(sys.stderr),
        "stdin": _stream(sys.stdin),
        "stdin_target": os.readlink("/proc/self/fd/0")
        if os.path.exists("/proc/self/fd/0")
        else None,
        "stdin_isatty": sys.stdin.isatty() if sys.stdin else None,
        "fds": _fds(),
        "mp_start_method": multiprocessing.get_start_method(allow_none=True),
        "mp_current": multiprocessing.current_process().name,
        "mp_parent": multiprocessing.parent_process() is None,
        "main_thread": threading.current_thread() is threading.main_thread(),
        "main_thread_name": threading.main_thread().name,
        "ident_is_main": threading.get_ident() == threading.main_thread().ident,
        "sys_path_importer_cache": len(sys.path_importer_cache),
        "meta_path": [
            type(f).__name__ if not isinstance(f, type) else f.__name__ for f in sys.meta_path
        ],
        "path_hooks": len(sys.path_hooks),
        "stdout_console": os.readlink("/proc/self/fd/1"),
        "umask_after": os.umask(0o022),
    }
    return fp


def main() -> None:
    crash = "crash" in sys.argv[1:]
    fp = fingerprint()
    if "children" in sys.argv[1:] and RANK == 0 and not (crash and ATTEMPT == 0):
        fp["children"] = _children()
    fp["tasks_later"] = len(os.listdir("/proc/self/task"))
    _write_file(
        os.path.join(OUT, f"fp_{ATTEMPT}_{RANK}.json"), json.dumps(fp, indent=1, default=str)
    )
    other = os.path.join(OUT, f"fp_{ATTEMPT}_{1 - RANK}.json")
    deadline = time.monotonic() + 120
    while not os.path.exists(other) and time.monotonic() < deadline:
        time.sleep(0.02)
    if crash and ATTEMPT == 0:
        if RANK == 0:
            raise SystemExit(1)
        time.sleep(60)  # stopped by the launcher
        return
    if RANK == 1:
        done = os.path.join(OUT, f"atexit_{ATTEMPT}_0")
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.02)
        sys.exit(3)


if __name__ == "__main__":
    main()
