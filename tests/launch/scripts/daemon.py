"""Starts a daemon the hard way (setsid, double fork, cleared environment), records its
pid, then exits 0 ("exit"), fails on the first attempt ("fail"; "failwait": then sleeps), or
sleeps ("wait"; "ignore": and ignores SIGTERM).  Sleeping, it writes ``ready_<attempt>_<rank>``."""

import os
import signal
import subprocess
import sys
import time

out_dir, mode = sys.argv[1], sys.argv[2]
rank = os.environ["RANK"]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
pid_file = os.path.join(out_dir, f"daemon_{attempt}_{rank}")
# Where this worker runs, so that the test can look for its own job's cgroup only.
with open("/proc/self/cgroup") as fh:
    own = next(ln[3:].strip() for ln in fh if ln.startswith("0::"))
with open(os.path.join(out_dir, f"cgroup_{attempt}_{rank}"), "w") as fh:
    fh.write(own)
body = (
    "import os, sys, time\n"
    "tmp = sys.argv[1] + '.tmp'\n"
    "open(tmp, 'w').write(str(os.getpid()))\n"
    "os.rename(tmp, sys.argv[1])\n"
    "time.sleep(600)\n"
)
# setsid -f: a new session, and the process that runs env is forked off and orphaned.
subprocess.run(["setsid", "-f", "env", "-i", sys.executable, "-c", body, pid_file], check=True)
while not os.path.exists(pid_file):
    time.sleep(0.01)
if mode in ("fail", "failwait") and attempt == "0":
    # Only once every rank's daemon runs, so that the restart has them all to clean up.
    peers = [os.path.join(out_dir, f"daemon_0_{r}") for r in range(int(os.environ["WORLD_SIZE"]))]
    while not all(os.path.exists(p) for p in peers):
        time.sleep(0.01)
    sys.exit(1)
if mode == "ignore":
    term = os.path.join(out_dir, f"term_{rank}")
    signal.signal(signal.SIGTERM, lambda *_: os.close(os.open(term, os.O_CREAT | os.O_WRONLY)))
if mode in ("wait", "ignore", "failwait"):
    open(os.path.join(out_dir, f"ready_{attempt}_{rank}"), "w").close()
    while True:
        time.sleep(0.1)
