"""Records what a worker sees of its own start, for comparing warm and cold workers."""

import json
import multiprocessing
import os
import signal
import sys
import threading
import time

preloaded = "torch" in sys.modules  # before this script imported anything heavy
out = sys.argv[1]
info = {
    "name": __name__,
    "argv": sys.argv[1:],
    "argv0": os.path.basename(sys.argv[0]),
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "rank": os.environ["RANK"],
    "restart": os.environ["TORCHELASTIC_RESTART_COUNT"],
    "custom": os.environ.get("SEMANTICS_VAR"),
    "error_file": os.environ["TORCHELASTIC_ERROR_FILE"].endswith("error.json"),
    "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "sigmask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "pgid_is_pid": os.getpgid(0) == os.getpid(),
    "stdout_tty": sys.stdout.isatty(),
    "main_file": os.path.basename(sys.modules["__main__"].__file__),
    "orig_argv": sys.orig_argv,
    "mp": [multiprocessing.current_process().name, multiprocessing.parent_process() is None],
    "main_thread": threading.current_thread() is threading.main_thread(),
    "threads": threading.active_count(),
}
mode = "warm" if preloaded else "cold"
tmp = os.path.join(out, f"sem_{info['rank']}_{mode}.tmp")
with open(tmp, "w") as fh:
    json.dump(info, fh)
os.rename(tmp, os.path.join(out, f"sem_{info['rank']}_{mode}.json"))
print(f"semantics rank {info['rank']}", flush=True)
if len(sys.argv) > 2 and sys.argv[2] == "fail" and info["rank"] == "0":
    # Fail only once rank 1 has written its record, or the launcher would stop it first.
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, f"sem_1_{mode}.json")):
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    raise SystemExit(7)
