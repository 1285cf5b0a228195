"""Evidence that a rank past its deadline is hung, and whether it waits on its peers.

A missed deadline that was *learned* (no timeout configured) is only a suspicion: an
evaluation pass, a slow checkpoint, a first-step compilation or a data loader warming up
misses it too while running code. The monitor then samples the rank's processes twice,
`CONFIRM_WAIT` apart, and `is_hung` (pure) decides from the two samples. The first look
is taken `CONFIRM_WAIT` before the deadline once the rank is late by its rhythm
(`judge.lookout`), so the second falls on the deadline (`decision_at`): a hung rank is
decided at its deadline, not a window after it. A rank that makes progress between the
looks is no longer suspected, and its first look is thrown away.

* stopped (``T``: SIGSTOP, a debugger) at either sample: hung;
* blocked: the rank's processes (it and its descendants, so data-loader workers count)
  used less than `IDLE_SHARE` of one core between the samples, the rank itself is
  asleep in a wait (``S``: a collective, a lock, a sleep, a socket, a queue), and no
  thread of them was running or in I/O at either sample (a checkpoint writer fsyncing
  while the rank waits for it is not a hang): hung;
* anything else (running, in uninterruptible I/O ``D``, busy, or a main thread that
  woke `LIVE_WAKEUPS` times or more between the samples: a loop that naps between
  batches, such as an evaluation pass behind a slow data source): not hung, looked at
  again a window later. A wait on the peers, a sleep in place of work or a blocked
  queue wakes the main thread at most once in that time.

Who is to blame among hung ranks comes from their stacks, taken when the suspicion
began: `role` (pure) reads the innermost frames of the stack faulthandler wrote; a rank
inside a collective or a wait on its peers (a ``torch.distributed`` call, DDP's reducer
in ``backward``, a device synchronise) is WAITING, a rank anywhere else (its own code,
a sleep, a data loader, I/O) is ELSEWHERE, and a stopped rank is ELSEWHERE whatever its
stack. `judge.blame` puts the ranks that are not waiting first.

A stack is only evidence for the quiet it was written in (`stack_look`): a rank asked at
the episode's start while it was busy (restoring a checkpoint, replaying its data) and
found quiet only later, waiting in a collective on a peer still busy, has a dump that
shows where it worked, not where it waits. It is asked again, and judged on that dump.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re

import psutil

#: Seconds between the two samples of a suspected rank.
CONFIRM_WAIT = 0.3
#: Below this share of one core between the samples, the rank's processes ran no code.
IDLE_SHARE = 0.1
#: Voluntary context switches of the main thread between the samples that show it
#: looping rather than blocked (a wait on the peers showed none in 1 s on gloo).
LIVE_WAKEUPS = 3
#: Innermost frames of the main thread's stack that `role` reads.
INNERMOST = 4
#: Threads of one process looked at for `ProcSample.busy`.
MAX_THREADS = 1024
#: Longest stack text `role` reads (a rank's dump can be anything it wrote).
MAX_STACK_CHARS = 256 * 1024
#: How long a rank asked again for its stacks may take to write them before it is judged
#: on what its file holds (a rank in a wait is woken by the signal at once; this bounds a
#: rank that is never scheduled on a loaded node).
DUMP_PATIENCE = 1.0
#: How often the scanner looks for a dump asked again.
DUMP_POLL = 0.05

# (file path fragment, function or None for any): frames that wait on the other ranks.
_WAITS: tuple[tuple[str, str | None], ...] = (
    ("torch/distributed/distributed_c10d.py", None),
    ("torch/distributed/_functional_collectives", None),
    ("torch/distributed/c10d_logger.py", None),
    ("torch/distributed/", "wait"),
    ("torch/distributed/", "barrier"),
    ("torch/nn/parallel/distributed.py", None),  # DDP's buffer broadcast, bucket rebuild
    ("torch/autograd/graph.py", "_engine_run_backward"),  # DDP's reducer all-reduces here
    ("torch/autograd/__init__.py", "backward"),
    ("torch/cuda/", "synchronize"),
    ("torch/futures/", "wait"),
    # stalwart's restore agreeing on a step: through the job's store when no process
    # group exists, where the wait (store.wait/get, C++) leaves no torch.distributed frame.
    ("stalwart/checkpoint/resume.py", "all_gather"),
)
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line \d+ in (?P<func>\S+)')
_THREAD = re.compile(r"^(?:Current thread|Thread) (?P<id>0x[0-9a-fA-F]+)")
# faulthandler's line in place of the threads past its limit (100): the main thread,
# listed last, is among those left out.
_MORE_THREADS = "..."


class Role(enum.Enum):
    WAITING = "waiting"  # blocked on the other ranks: a victim
    ELSEWHERE = "elsewhere"  # not waiting on the others: the root cause
    UNKNOWN = "unknown"  # no stack to read


@dataclasses.dataclass(frozen=True)
class ProcSample:
    """One look at a rank's processes."""

    at: float  # monotonic time of the sample
    state: str  # the rank's own process state letter (R, S, D, T, t, Z, ...)
    cpu: float  # user+system seconds of the rank and its descendants
    #: Some thread of the rank or of a descendant was running (R) or in I/O (D): a
    #: checkpoint writer, a data-loader worker, an evaluation thread at work.
    busy: bool = False
    #: Voluntary context switches of the rank's main thread so far (0: unknown).
    wakeups: int = 0


@dataclasses.dataclass(frozen=True)
class Reading:
    """What a rank's stack says."""

    role: Role
    where: str  # the innermost frame, "file:line in func", or why there is none


def is_hung(first: ProcSample, second: ProcSample) -> bool:
    """Whether two samples show a rank that runs no code (see the module's rules)."""
    if first.state in ("T", "t") or second.state in ("T", "t"):
        return True
    wall = second.at - first.at
    if wall <= 0 or second.state != "S" or first.busy or second.busy:
        return False
    if second.wakeups - first.wakeups >= LIVE_WAKEUPS:
        return False
    return (second.cpu - first.cpu) < IDLE_SHARE * wall


class StackLook(enum.Enum):
    """What to do with a rank the samples found hung, before its stack is read."""

    READ = "read"  # the dump on file was written during the quiet: judge on it
    ASK = "ask"  # it predates the quiet the samples show: ask for a fresh one first
    WAIT = "wait"  # a fresh one was asked for and has not arrived yet


def stack_look(
    stopped: bool,
    can_ask: bool,
    at_ask: ProcSample | None,
    now_sample: ProcSample,
    dumped: bool,
    patience: float = DUMP_PATIENCE,
) -> StackLook:
    """Whether the dump of a rank the samples found hung shows where it is stuck (pure).

    `at_ask`: the rank's sample taken when the dump on file was asked for (None: never
    asked); `now_sample`: the sample that found it hung; `dumped`: the file grew since
    that ask; `can_ask`: the rank has a stacks file to ask for. The dump is evidence
    when the rank ran no code from that ask to now (`is_hung` over the two samples);
    one that ran code since was asked while it worked and is asked again. A stopped
    rank's state is the evidence, whatever its stack."""
    if stopped or not can_ask:
        return StackLook.READ
    if at_ask is None:
        return StackLook.ASK
    if at_ask.at < now_sample.at and not is_hung(at_ask, now_sample):
        return StackLook.ASK
    if not dumped and now_sample.at - at_ask.at < patience:
        return StackLook.WAIT
    return StackLook.READ


def decision_at(first_at: float, due: float, wait: float = CONFIRM_WAIT) -> float:
    """When the second look at a rank first sampled at `first_at` may decide: `wait`
    after the first look and never before the rank's deadline `due` (looking early
    saves the window's time; it does not move the deadline)."""
    return max(first_at + wait, due)


def main_stack(text: str) -> list[tuple[str, str, str]]:
    """The frames (file, line text, function) of the main thread in the first dump of
    `text`, innermost first; empty when that dump does not show it.

    Not the "Current thread": that is the thread the kernel handed the signal to, the
    main one only while it does not block the signal (a program masking it in its
    main thread has it delivered to any other, a busy worker thread included). CPython
    lists a dump's threads newest first, so the main thread, the interpreter's first,
    is the last block of the dump; a thread id seen again starts the next dump (the
    file is appended to)."""
    blocks: list[list[tuple[str, str, str]]] = []
    seen: set[str] = set()
    for line in text[:MAX_STACK_CHARS].splitlines():
        head = _THREAD.match(line)
        if head is not None:
            if head.group("id") in seen:
                break
            seen.add(head.group("id"))
            blocks.append([])
            continue
        if line == _MORE_THREADS and blocks:
            return []
        frame = _FRAME.match(line)
        if frame is not None and blocks:
            blocks[-1].append((frame.group("file"), line.strip(), frame.group("func")))
    return blocks[-1] if blocks else []


def role(text: str, stopped: bool) -> Reading:
    """Whether a rank whose main thread shows `text` waits on its peers (pure)."""
    frames = main_stack(text)
    where = frames[0][1] if frames else "no stack"
    if stopped:
        return Reading(Role.ELSEWHERE, f"stopped (state T) at {where}")
    if not frames:
        return Reading(Role.UNKNOWN, where)
    for file, line, func in frames[:INNERMOST]:
        path = file.replace("\\", "/")
        for fragment, name in _WAITS:
            if fragment in path and (name is None or func == name):
                return Reading(Role.WAITING, f"waiting on peers: {line}")
    return Reading(Role.ELSEWHERE, f"not waiting on peers: {where}")


def sample(pid: int, now: float) -> ProcSample | None:
    """The rank's state, the CPU time of it and its descendants, and whether any of
    their threads runs or waits on I/O; None once it is gone."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            state = _STATE.get(proc.status(), "?")
            times = proc.cpu_times()
        cpu = times.user + times.system
        busy = _threads_busy(pid)
        for child in proc.children(recursive=True):
            try:
                t = child.cpu_times()
            except psutil.Error:
                continue
            cpu += t.user + t.system
            busy = busy or _threads_busy(child.pid)
    except psutil.Error:
        return None
    return ProcSample(now, state, cpu, busy, _main_wakeups(pid))


def _main_wakeups(pid: int) -> int:
    """Voluntary context switches of `pid`'s main thread (0 when unreadable)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/status", "rb") as f:
            raw = f.read(8192)
    except OSError:
        return 0
    for line in raw.splitlines():
        if line.startswith(b"voluntary_ctxt_switches:"):
            value = line.partition(b":")[2].strip()
            return int(value) if value.isdigit() and len(value) < 20 else 0
    return 0


def _threads_busy(pid: int) -> bool:
    """A thread of `pid` other than a zombie is running (R) or in I/O (D)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids[:MAX_THREADS]:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                raw = f.read(4096)
        except OSError:
            continue
        after = raw.rpartition(b")")[2].split()
        if after and after[0] in (b"R", b"D"):
            return True
    return False


_STATE = {
    psutil.STATUS_RUNNING: "R",
    psutil.STATUS_SLEEPING: "S",
    psutil.STATUS_DISK_SLEEP: "D",
    psutil.STATUS_STOPPED: "T",
    psutil.STATUS_TRACING_STOP: "t",
    psutil.STATUS_ZOMBIE: "Z",
    psutil.STATUS_DEAD: "X",
    psutil.STATUS_IDLE: "I",
}
