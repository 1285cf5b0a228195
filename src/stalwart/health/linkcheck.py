"""One node's side of a round's collective link check: who takes part, and its process.

The round's nodes come to the check one by one (each after its own checks), so its
members are sealed once: when as many nodes came as the job can have, or when every
node that started checking came and nobody new started for `GATHER` seconds, or after
`GATHER_CAP` (``seal_now``, pure). The first node to see that writes
the signed member list; a node that comes after it is not a member and is judged by
its echo times only. The first member's check process serves the store the check's
process groups meet on and leaves its address, signed, for the others.

The check itself runs in a process of its own (``linkrun``, `CheckProcess`), killed with
its whole session at `LinkCheck`'s bound: a hung collective costs the bound, never the
launcher, and never touches the workers' process group. Where the node has a warm
template (torch imported, ``launch/workers/zygote.py``) the process is forked from it: no
interpreter start and no torch import of its own, which on a loaded host were most of the
check's time (measured in docs/benchmarks.md). Without one (``--no-warm``, or a template
that cannot fork) it is a new interpreter, started when the node starts checking so that
importing torch overlaps its other checks. Its orders, with the key its timings are signed
with, go through a pipe either way, never the store.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec

from stalwart.health.judge import Limits
from stalwart.health.linkrun import Orders, Serving
from stalwart.health.records import (
    ID_LIMIT,
    MAX_LINKS,
    BadRecord,
    CollectiveLinks,
    LinkPlan,
    LinkStore,
    link_coming,
    link_count,
    link_node,
    link_plan_key,
    link_store_key,
    open_link_plan,
    open_link_store,
    sign,
)
from stalwart.rendezvous import keys

logger = logging.getLogger(__name__)

#: Seconds with no newcomer after which the check's members are sealed.
GATHER = 3.0
#: Seconds a node waits for its members at most, counted from its own arrival.
GATHER_CAP = 15.0
_POLL = 0.05
# How often a wait for the check's process also looks whether the job ended.
_LINE_POLL = 0.25
_LINE_LIMIT = 512 * 1024


class Store(Protocol):
    def get(self, key: str) -> bytes | None: ...
    def get_many(self, keys: list[str]) -> list[bytes | None]: ...
    def set(self, key: str, value: str, *, leased: bool = False) -> None: ...
    def create(self, key: str, value: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...


def seal_now(came: int, coming: int, expected: int, quiet_for: float, waited: float) -> bool:
    """Whether the check's members are complete: every node the job can have *came*,
    or every node *coming* (it started checking) came, at least two, and nobody new
    appeared for `GATHER` seconds, or this node waited `GATHER_CAP`. Not one alone: a
    spare that checks again while the others still stop their workers (a restart to
    admit it) would seal a check of one, and those others could only echo-time it."""
    quiet = came >= max(coming, 2) and quiet_for >= GATHER
    return came >= expected or quiet or waited >= GATHER_CAP


def check_key(key: bytes) -> bytes:
    """The key the check's timings are signed with (derived: the health key itself never
    leaves the launcher)."""
    return hmac.new(key, b"stalwart-links/1", hashlib.sha256).digest()


class Forker(Protocol):
    """What forks the check from a process that has torch imported (the warm template)."""

    def fork_link_check(self, fds: list[int]) -> int | None:
        """The pid of a check forked with *fds* as its stdin, stdout and stderr (a child
        of ours); None: start it cold."""
        ...


class CheckProcess:
    """The check's process and its pipes: forked from *forker* when given (waiting, in a
    thread of its own, while the template still imports), else a new interpreter. The
    pipes come first, so the orders can be written and the lines read the same way
    whichever it is, and before it exists."""

    def __init__(self, forker: Forker | None) -> None:
        self._forker = forker
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        self._stopped = False
        # Keeps the thread that started a cold fallback alive until stop(): the cold
        # process's parent-death signal fires when the thread that forked it ends.
        self._released = threading.Event()
        self._stdin = -1
        self._stdout = -1
        self.err = tempfile.TemporaryFile()  # noqa: SIM115  # closed in stop()
        self.lines: queue.Queue[bytes] = queue.Queue()
        self.how = ""  # "template" or "cold" once started
        self.started_at: float | None = None  # monotonic time it was forked or spawned

    def start(self) -> None:
        child_in, self._stdin = os.pipe2(os.O_CLOEXEC)
        self._stdout, child_out = os.pipe2(os.O_CLOEXEC)
        # The orders are written at once, whether the process reads them yet or not.
        os.set_blocking(self._stdin, False)
        # The process's copies, closed here once it has them: a copy of the error file's
        # descriptor, so that stop() may close the file while a fork is still pending.
        ends = [child_in, child_out, os.dup(self.err.fileno())]
        threading.Thread(target=self._pump, name="stalwart-linkcheck", daemon=True).start()
        if self._forker is None:
            try:
                self._cold(ends)
            finally:
                for fd in ends:
                    os.close(fd)
        else:
            threading.Thread(
                target=self._warm, args=(self._forker, ends), name="stalwart-linkfork", daemon=True
            ).start()

    def _warm(self, forker: Forker, ends: list[int]) -> None:
        pid = None
        try:
            pid = forker.fork_link_check(ends)
        except (OSError, ValueError) as err:
            logger.warning("the link check starts cold: %s", err)
        try:
            if pid is None:
                self._cold(ends)
            else:
                with self._lock:
                    self._pid, self.how, self.started_at = pid, "template", time.monotonic()
                    if self._stopped:
                        self._kill()
        finally:
            for fd in ends:
                os.close(fd)
        if pid is None:
            self._released.wait()

    def _cold(self, ends: list[int]) -> None:
        with self._lock:
            if self._stopped:
                return
            self._popen = subprocess.Popen(
                [sys.executable, "-m", "stalwart.health.linkrun", str(os.getpid())],
                stdin=ends[0],
                stdout=ends[1],
                stderr=ends[2],
                start_new_session=True,  # killed as a whole at the bound
            )
            self.how, self.started_at = "cold", time.monotonic()

    def _pump(self) -> None:
        with os.fdopen(self._stdout, "rb") as out:
            for line in iter(lambda: out.readline(_LINE_LIMIT), b""):
                self.lines.put(line)
        self.lines.put(b"")  # it ended: no need to wait out the bound

    def alive(self) -> bool:
        """False once the process is known to have ended (not started yet: alive)."""
        with self._lock:
            if self._popen is not None:
                return self._popen.poll() is None
            if self._pid is not None:
                try:
                    ended = os.waitpid(self._pid, os.WNOHANG)[0] != 0
                except ChildProcessError:
                    ended = True  # reaped elsewhere
                if ended:
                    self._pid = None
                return not ended
            return not self._stopped and self.how != "template"

    def order(self, data: bytes) -> None:
        """Writes *data* to its stdin; OSError when it cannot take them (it ended)."""
        if len(data) > fcntl.fcntl(self._stdin, fcntl.F_GETPIPE_SZ):
            raise OSError(f"orders of {len(data)} bytes do not fit the pipe")
        os.write(self._stdin, data)

    def _kill(self) -> None:
        """Holds the lock."""
        if self._popen is not None:
            if self._popen.poll() is None:
                try:
                    os.killpg(self._popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._popen.wait()
        elif self._pid is not None:
            # Its own session once it runs; the pid alone before that.
            for kill in (os.killpg, os.kill):
                try:
                    kill(self._pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                os.waitpid(self._pid, 0)  # ours: re-parented to this subreaper
            except ChildProcessError:
                pass  # reaped elsewhere (a teardown's stray scan)
            self._pid = None

    def stop(self) -> None:
        """Kills the process and whatever it started (idempotent; also when it has not
        been forked yet: it is killed as soon as it is)."""
        with self._lock:
            self._stopped = True
            self._kill()
            self._popen = None
        self._released.set()
        if self._stdin >= 0:
            os.close(self._stdin)
            self._stdin = -1
        self.err.close()

    def last_error(self) -> str:
        """The last line it wrote to stderr ("" if none)."""
        if self.err.closed:
            return ""
        self.err.seek(0)
        tail = self.err.read()[-2000:].decode(errors="replace").strip().splitlines()
        return tail[-1][:200] if tail else ""


class LinkCheck:
    """This node's collective link check for one round."""

    def __init__(
        self,
        key: bytes,
        run_id: str,
        *,
        expected: int,
        limits: Limits,
        bound: float,
        forker: Forker | None = None,
    ) -> None:
        self._key = key
        self._run_id = run_id
        self._expected = expected
        self._limits = limits
        self._bound = bound
        self._forker = forker
        self._proc: CheckProcess | None = None
        self._t0 = 0.0
        self._kv: Store | None = None  # the round's store, while `run` takes part
        self.timing: dict[str, float | str] = {}  # where the time went, for the event

    def start(self) -> None:
        """Starts the check's process: forked from the warm template, or a new one that
        imports torch while the node checks itself."""
        self._t0 = time.monotonic()
        self._proc = CheckProcess(self._forker)
        self._proc.start()

    def coming(self, kv: Store, round_: int) -> None:
        """Tells the round this node is checking, and will come to the link check."""
        kv.add(link_coming(round_), 1)

    def _left(self) -> float:
        """Seconds left of the bound; none once the job ended: a spare checking for a
        round that will never come leaves with the job instead of waiting it out."""
        if self._kv is not None and self._kv.get(keys.JOB_ENDED) is not None:
            return 0.0
        return self._t0 + self._bound - time.monotonic()

    def run(
        self,
        kv: Store,
        round_: int,
        node: str,
        addr: str,
        reported: Callable[[Sequence[str]], Sequence[str]],
    ) -> CollectiveLinks | None:
        """Takes part in *round_*'s check as *node*; None when it is not a member (it
        came after the members were sealed). *reported*: which of some node ids left a
        valid report for the round (a name a stranger wrote is no member)."""
        if self._proc is None:
            self.start()
        self._t0 = time.monotonic()  # the bound counts from here (started ahead: idle)
        self._kv = kv
        try:
            members = self._members(kv, round_, node, reported)
            self.timing["gather_s"] = round(time.monotonic() - self._t0, 4)
            if isinstance(members, str):
                return self._void((node,), members)
            if node not in members:
                logger.info("came after round %d's link check was sealed: echo times only", round_)
                return None
            if len(members) < 2:
                return None  # nobody to time a link to
            return self._check(kv, round_, node, members, addr)
        finally:
            proc = self._proc
            if proc is not None:
                self.timing["start"] = proc.how or "not started"
                if proc.started_at is not None:
                    # How long this run waited for the process to exist (0: it was ready).
                    self.timing["fork_wait_s"] = round(max(0.0, proc.started_at - self._t0), 4)
            self.timing["total_s"] = round(time.monotonic() - self._t0, 4)
            self.stop()

    def _members(
        self,
        kv: Store,
        round_: int,
        node: str,
        reported: Callable[[Sequence[str]], Sequence[str]],
    ) -> tuple[str, ...] | str:
        i = kv.add(link_count(round_), 1) - 1
        kv.set(link_node(round_, i), node)
        t0 = last = time.monotonic()
        seen = (-1, -1)
        while (raw := kv.get(link_plan_key(round_))) is None:
            now = time.monotonic()
            came = min(kv.add(link_count(round_), 0), MAX_LINKS)
            coming = kv.add(link_coming(round_), 0)
            if (came, coming) != seen:
                seen, last = (came, coming), now
            if seal_now(came, coming, self._expected, now - last, now - t0):
                names = kv.get_many([link_node(round_, j) for j in range(came)])
                ids = [n.decode(errors="replace")[:ID_LIMIT] for n in names if n is not None]
                members = tuple(dict.fromkeys(reported(list(dict.fromkeys(ids)))))
                plan = LinkPlan(run_id=self._run_id, round=round_, members=members)
                kv.create(link_plan_key(round_), sign(self._key, plan))
                continue
            if self._left() <= 0:
                return "the members were not sealed within the bound"
            time.sleep(_POLL)
        try:
            return open_link_plan(self._key, raw, self._run_id, round_).members
        except BadRecord as err:
            logger.warning("the link check of round %d is off: its member list: %s", round_, err)
            return f"a bad member list: {err}"

    def _line(self) -> bytes | None:
        """The process's next line; None when it ended or its bound passed first."""
        assert self._proc is not None
        while (left := self._left()) > 0:
            try:
                return self._proc.lines.get(timeout=min(left, _LINE_POLL)) or None
            except queue.Empty:
                continue
        return None

    def _check(
        self, kv: Store, round_: int, node: str, members: tuple[str, ...], addr: str
    ) -> CollectiveLinks:
        proc = self._proc
        assert proc is not None
        rank = members.index(node)
        store = ""
        if rank > 0:
            found = self._store_of(kv, round_)
            if found is None or found.startswith("!"):
                return self._void(members, found[1:] if found else "no store from its first member")
            store = found
        orders = Orders(
            rank=rank,
            members=members,
            host=addr,
            store=store,
            prefix=f"stalwart-links/r{round_}",
            key=check_key(self._key).hex(),
            limits=self._limits,
        )
        try:
            proc.order(msgspec.json.encode(orders) + b"\n")
        except OSError as err:  # it died while importing torch
            return self._void(members, f"its process ended early: {err}")
        if rank == 0:
            line = self._line()
            try:
                served = msgspec.json.decode(line or b"", type=Serving)
            except msgspec.DecodeError:
                return self._void(members, "its process did not serve the store")
            rec = LinkStore(run_id=self._run_id, round=round_, address=served.store)
            kv.create(link_store_key(round_), sign(self._key, rec))
        line = self._line()
        if line is None:
            return self._void(members, f"no result (it ended, or ran past {self._bound:g}s)")
        try:
            return msgspec.json.decode(line, type=CollectiveLinks)
        except msgspec.DecodeError as err:
            return self._void(members, f"not a result: {err}")

    def _store_of(self, kv: Store, round_: int) -> str | None:
        """The check's store, as its first member signed it ("!why": not to be had)."""
        while (raw := kv.get(link_store_key(round_))) is None:
            if self._left() <= 0 or self._proc is None or not self._proc.alive():
                return None
            time.sleep(_POLL)
        try:
            return open_link_store(self._key, raw, self._run_id, round_).address
        except BadRecord as err:
            return f"!its store's address: {err}"

    def _void(self, members: tuple[str, ...], why: str) -> CollectiveLinks:
        last = self._proc.last_error() if self._proc is not None else ""
        err = f" ({last})" if last else ""
        logger.warning("the collective link check found nothing: %s%s", why, err)
        return CollectiveLinks(members=members, void=why[:400])

    def stop(self) -> None:
        """Kills the check's process and everything it started (idempotent)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.stop()
