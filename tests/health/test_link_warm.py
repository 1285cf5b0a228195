"""The collective link check forked from the warm template: it is the template's child
(its environment is the template's, its torch came with it), it carries none of a
worker's state, and a stranger on its store still cannot pass off a timing. One real
template serves every test here; the check processes, their TCPStore and gloo groups
are real."""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import os
import secrets
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import msgspec
import psutil
import pytest
from torch._C._distributed_c10d import TCPStore

from stalwart.base.events import Event
from stalwart.health.judge import Limits
from stalwart.health.linkcheck import LinkCheck, check_key
from stalwart.health.linkrun import Orders, sealed
from stalwart.health.records import CollectiveLinks, health_key
from stalwart.launch.workers.warm import WarmPool
from stalwart.rendezvous.kv import MemoryKV, MemoryStore
from tests.helpers import alive, wait_for

pytestmark = pytest.mark.timeout(120)

KEY = health_key(secrets.token_bytes(32), "job")
MARK = f"template-{secrets.token_hex(4)}"
_PR_SET_CHILD_SUBREAPER = 36


EVENTS: list[object] = []


@pytest.fixture(scope="module")
def pool() -> Iterator[WarmPool]:
    """A warm template whose environment carries MARK (this process's does not), with
    this process as the subreaper its forks are re-parented to, as the launcher is.
    Handed over still importing (the first test forks from it then)."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    env = {**os.environ, "STALWART_TEST_MARK": MARK, "OMP_NUM_THREADS": "1"}
    wp = WarmPool([], env, lambda kind, **_: EVENTS.append(kind))
    wp.start()
    try:
        yield wp
    finally:
        wp.close()
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


_TITLE = ["-m", "stalwart.health.linkrun"]


class Watched:
    """The pool as the check's forker, noting what each forked process looks like."""

    def __init__(self, pool: WarmPool) -> None:
        self.pool = pool
        self.seen: list[dict[str, Any]] = []

    def fork_link_check(self, fds: list[int]) -> int | None:
        pid = self.pool.fork_link_check(fds)
        assert pid is not None
        ready = Event.TEMPLATE_READY in EVENTS
        p = psutil.Process(pid)
        # The child takes its title a moment after the fork answered: wait for it (a
        # child that never becomes the check keeps the template's and fails below).
        deadline = time.monotonic() + 30
        cmd = p.cmdline()
        while " ".join(cmd).split()[1:] != _TITLE and time.monotonic() < deadline:
            time.sleep(0.02)
            cmd = p.cmdline()
        self.seen.append(
            {
                "pid": pid,
                "env": p.environ(),
                "ppid": p.ppid(),
                "children": p.children(),
                "cmd": cmd,
                "template_ready": ready,
            }
        )
        return pid


def test_the_check_is_forked_from_the_template_and_carries_no_worker_state(
    pool: WarmPool,
) -> None:
    """Two members time their link to the end; both processes were forked from the
    template (its environment, re-parented to us) while it was still importing (as soon
    as torch.distributed was in, before it said it was ready), none made a checkpoint
    writer seed as a worker does, and the old way (a new interpreter per check) was not
    taken."""
    forker = Watched(pool)
    kv = MemoryKV(MemoryStore())
    checks = {
        n: LinkCheck(KEY, "job", expected=2, limits=Limits(), bound=60.0, forker=forker)
        for n in ("n0", "n1")
    }
    found: dict[str, CollectiveLinks | None] = {}

    def member(n: str) -> None:
        found[n] = checks[n].run(kv, 0, n, "127.0.0.1", lambda ns: list(ns))

    for c in checks.values():
        c.start()
    # Both forked before either gets its orders: one template serves both "nodes" here,
    # and the second fork waits for the first's answer, then for the template's readiness
    # (on a loaded host longer than a member waits for the others to be ready).
    wait_for(lambda: len(forker.seen) == 2, 90, "both forks")
    threads = [threading.Thread(target=member, args=(n,)) for n in checks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    for n, c in checks.items():
        got = found[n]
        assert got is not None and got.void == "" and got.backend == "gloo", (n, got)
        assert got.stages >= 1 and got.nodes == () and got.links == (), got
        assert c.timing["start"] == "template", c.timing
    assert len(forker.seen) == 2
    for seen in forker.seen:
        assert seen["env"].get("STALWART_TEST_MARK") == MARK  # the template's environment
        assert seen["ppid"] == os.getpid()  # re-parented to the subreaper, as to a launcher
        assert seen["children"] == []  # no checkpoint writer seed: not a worker
        # What ps shows, as for a check started cold (its title, over the template's).
        assert " ".join(seen["cmd"]).split()[1:] == _TITLE, seen["cmd"]
    # The first fork came while the template was importing: as soon as torch.distributed
    # was in, before it said it was ready (the second waited for the first's answer).
    assert [seen["template_ready"] for seen in forker.seen][:1] == [False], forker.seen
    assert pool.ensure() and Event.TEMPLATE_READY in EVENTS  # and it got ready after
    # The template serves on: a third check forks as the first two did, and its stop
    # kills and reaps it (the first two ended on their own).
    again = LinkCheck(KEY, "job", expected=2, limits=Limits(), bound=5.0, forker=forker)
    again.start()
    wait_for(lambda: len(forker.seen) == 3, 60, "a third fork")
    pid = forker.seen[2]["pid"]
    assert alive(pid)
    again.stop()
    with pytest.raises(psutil.NoSuchProcess):
        psutil.Process(pid).status()


def test_hostile_timings_in_the_check_store_void_a_forked_check(pool: WarmPool) -> None:
    """Two forked members meet on a store (a third, n0, said it was ready and vanished)
    where a stranger planted the first stage's timings first: oversized values, and
    values signed with another key. Neither is taken: both members conclude nothing and
    blame nobody, n0 included."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=5))  # fmt: skip
    prefix = "stalwart-links/r0"
    ready = f"{prefix}/ready/0"
    mac = hmac.new(check_key(KEY), (ready + "\0" + "1").encode(), hashlib.sha256).hexdigest()
    store.set(ready, f"1|{mac}")  # a genuine word of readiness, as n0's would be
    wrong = check_key(health_key(b"y" * 32, "job"))
    for g, size in enumerate((3, 2, 2)):  # stage 0 of three: the whole group, two pairs
        for i in range(size):
            where = f"{prefix}/s0/g{g}/t{i}"
            store.set(where, "9" * 4096 if i == 0 else sealed(wrong, where, 0.001))
    outs = []
    for rank in (1, 2):
        orders = Orders(
            rank=rank,
            members=("n0", "n1", "n2"),
            host="127.0.0.1",
            store=f"127.0.0.1:{store.port}",
            prefix=prefix,
            key=check_key(KEY).hex(),
            stage_timeout=1.0,
        )
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = pool.fork_link_check([stdin_r, stdout_w, err_w])
        assert pid is not None
        for fd in (stdin_r, stdout_w, err_w):
            os.close(fd)
        os.write(stdin_w, msgspec.json.encode(orders) + b"\n")
        os.close(stdin_w)
        outs.append((pid, stdout_r, err_r))
    for pid, stdout_r, err_r in outs:
        with os.fdopen(stdout_r, "rb") as out, os.fdopen(err_r, "rb") as err:
            lines = out.read().splitlines()
            tail = err.read().decode(errors="replace")[-2000:]
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, tail
        found = msgspec.json.decode(lines[-1], type=CollectiveLinks)
        assert found.nodes == () and found.links == (), found
        assert "forged timing" in found.void, found
        assert "a value of 4096 bytes" in found.void or "not signed" in found.void, found
