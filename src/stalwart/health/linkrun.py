"""The collective link check's process: one per node, short-lived, killed at its bound.

``python -m stalwart.health.linkrun`` imports torch while its launcher runs the node's
other checks, then reads its `Orders` (one JSON line on stdin: its rank among the
check's members, where their store is, the key its timings are signed with) and times
stage after stage of fixed-size all-reduces in small process groups of its own (gloo on
CPU, NCCL where a GPU is present), as ``linksplit.next_step`` asks. Each group's members
leave their signed times in the store under the stage's key; every member reads all of
them and so takes the same next step. It writes its conclusion (`CollectiveLinks`) as
one JSON line on stdout and exits. Its process groups are its own: nothing here touches
the workers' process group, and a hung collective dies with this process.

A first writer wins each timing key (``compare_set``): a member that finds a key empty
at the stage's deadline writes "failed" there, so every member reads the same trials.
A value that is not signed with the job's key voids the check (nobody is blamed): a
stranger who reaches the store can spoil the check but never frame a node.
"""

from __future__ import annotations

import hashlib
import hmac
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Annotated

import msgspec

from stalwart.base.procs import pdeathsig_then_check
from stalwart.health.judge import Limits
from stalwart.health.linksplit import Found, TimeGroups, Trial, next_step
from stalwart.health.records import ID_LIMIT, MAX_LINKS, Blame, CollectiveLinks, LinkBlame

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

#: Bytes all-reduced per group: large enough that a slow link shows in its time,
#: small enough that eight stages stay well under a second on a healthy network.
PAYLOAD = 256 * 1024
#: Stages at most (a bound on a check that keeps finding suspects).
MAX_STAGES = 12
#: Seconds a member waits for the others to be ready (their torch imported) before the
#: stages start without those still missing (the default of `Orders.start_wait`).
START_WAIT = 10.0
_VALUE_LIMIT = 256

_Id = Annotated[str, msgspec.Meta(max_length=ID_LIMIT)]


class Orders(msgspec.Struct, frozen=True, kw_only=True):
    """What the launcher tells its check process, once it knows the members."""

    rank: Annotated[int, msgspec.Meta(ge=0)]
    members: Annotated[tuple[_Id, ...], msgspec.Meta(min_length=1, max_length=MAX_LINKS)]
    host: _Id  # this node's advertised address (its gloo device binds it)
    store: _Id = ""  # "addr:port" of the first member's store; "": this one serves it
    prefix: _Id
    key: str  # hex; the key the timings are signed with (passed through the pipe only)
    device: str = "auto"  # "auto": a GPU when one is present, else the CPU
    payload: Annotated[int, msgspec.Meta(gt=0, le=64 * 2**20)] = PAYLOAD
    stage_timeout: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    start_wait: Annotated[float, msgspec.Meta(ge=0)] = START_WAIT
    limits: Limits = Limits()


class Serving(msgspec.Struct, frozen=True):
    """The first member's word to its launcher: where its store listens."""

    store: str


def _mac(key: bytes, where: str, value: str) -> str:
    return hmac.new(key, f"{where}\0{value}".encode(), hashlib.sha256).hexdigest()


def _seal(key: bytes, where: str, value: str) -> str:
    return f"{value}|{_mac(key, where, value)}"


def sealed(key: bytes, where: str, seconds: float | None) -> str:
    """A timing as stored at *where*: its value and MAC."""
    return _seal(key, where, "x" if seconds is None else repr(seconds))


class Forged(ValueError):
    pass


def _unseal(key: bytes, where: str, raw: bytes) -> str:
    if len(raw) > _VALUE_LIMIT:
        raise Forged(f"{where}: a value of {len(raw)} bytes (at most {_VALUE_LIMIT})")
    value, _, mac = raw.decode(errors="replace").rpartition("|")
    if not hmac.compare_digest(mac.encode(), _mac(key, where, value).encode()):
        raise Forged(f"{where}: not signed with the job's key")
    return value


def unseal(key: bytes, where: str, raw: bytes) -> float | None:
    """The timing at *where*; `Forged` when it is not one of this check's."""
    value = _unseal(key, where, raw)
    if value == "x":
        return None
    try:
        t = float(value)
    except ValueError:
        raise Forged(f"{where}: not a time: {value[:40]!r}") from None
    if not t >= 0.0:
        raise Forged(f"{where}: not a time: {value[:40]!r}")
    return t


class _Groups:
    """Makes one small process group at a time on the check's store, and times it."""

    def __init__(self, orders: Orders, connect: Callable[[], Store]) -> None:
        import torch
        import torch.distributed as dist

        self._torch = torch
        self._dist = dist
        self._o = orders
        self._connect = connect
        if orders.device != "auto":
            self.device = torch.device(orders.device)
        else:
            # The node's first visible GPU: the links between nodes are the same from
            # any of its GPUs' point of view, and NCCL is what the workers will use.
            self.device = (
                torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
            )
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"

    def _group(self, where: str, rank: int, size: int) -> object:
        dist = self._dist
        timeout = timedelta(seconds=self._o.stage_timeout)
        from torch._C._distributed_c10d import PrefixStore

        # A connection of its own (``connect``): a group whose peer never comes times
        # out in a store wait, and a timed-out wait leaves a TCPStore client unusable.
        store = PrefixStore(where, self._connect())
        if self.backend == "nccl":
            nccl = dist.ProcessGroupNCCL
            opts = nccl.Options()
            opts._timeout = timeout
            return nccl(store, rank, size, opts)
        gloo = dist.ProcessGroupGloo
        # An explicit device on the advertised address: the host name may resolve to
        # loopback, which peers cannot reach.
        gopts = gloo._Options()
        gopts._devices = [gloo.create_device(hostname=self._o.host)]
        gopts._timeout = timeout
        return gloo(store, rank, size, gopts)

    def time(self, where: str, rank: int, size: int) -> float | None:
        """Best of two all-reduces of the payload in a fresh group (None: it failed)."""
        torch = self._torch
        try:
            pg = self._group(where, rank, size)
            small = torch.ones(1, device=self.device)
            data = torch.ones(self._o.payload // 4, device=self.device)
            pg.allreduce([small]).wait()  # type: ignore[attr-defined]
            best = float("inf")
            for _ in range(2):
                self._sync()
                t0 = time.perf_counter()
                pg.allreduce([data]).wait()  # type: ignore[attr-defined]
                self._sync()
                best = min(best, time.perf_counter() - t0)
            return best
        except Exception:  # a peer gone, a timeout, a refused connection: the group failed
            return None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self._torch.cuda.synchronize(self.device)


def _stage(orders: Orders, store: Store, groups: _Groups, s: int, test: TimeGroups) -> list[Trial]:
    """Runs stage *s*: this member's group, then everyone's signed times."""
    key = bytes.fromhex(orders.key)
    me = orders.members[orders.rank]
    where = [
        [f"{orders.prefix}/s{s}/g{g}/t{i}" for i in range(len(nodes))]
        for g, nodes in enumerate(test.groups)
    ]
    for g, nodes in enumerate(test.groups):
        if me in nodes:
            i = nodes.index(me)
            t = groups.time(f"{orders.prefix}/s{s}/g{g}/pg", i, len(nodes))
            store.compare_set(where[g][i], "", sealed(key, where[g][i], t))
    # Polled, not ``wait``ed: a timed-out wait leaves a TCPStore client unusable. A key
    # still empty at the deadline is written "failed" below, for all alike.
    pending = [w for ws in where for w in ws]
    deadline = time.monotonic() + orders.stage_timeout * 2 + 1.0
    while pending and time.monotonic() < deadline:
        pending = [w for w in pending if not store.check([w])]
        if pending:
            time.sleep(0.005)
    trials = []
    for g, nodes in enumerate(test.groups):
        times = []
        for w in where[g]:
            raw = store.compare_set(w, "", sealed(key, w, None))
            times.append(unseal(key, w, raw))
        ok = [t for t in times if t is not None]
        # The fastest member's view: all ends of a group wait on its slowest link alike,
        # and one member's scheduler hiccup should not make the group look slow.
        trials.append(Trial(nodes, min(ok) if len(ok) == len(times) else None))
    return trials


def _roster(orders: Orders, store: Store) -> tuple[str, ...]:
    """The members present: each says it is ready (its torch imported, the store
    reached), and the first to see all of them, or to reach ``start_wait`` after its own
    word, writes who was (first writer wins), so the stages start together, among the
    same members everywhere. A member that was not ready in time is left out of the
    check: no evidence for or against it or its links."""
    key = bytes.fromhex(orders.key)
    p = orders.prefix
    mine = f"{p}/ready/{orders.rank}"
    store.compare_set(mine, "", _seal(key, mine, "1"))
    roster = f"{p}/roster"
    deadline = time.monotonic() + orders.start_wait
    present: set[int] = set()
    while not store.check([roster]):
        for i in set(range(len(orders.members))) - present:
            k = f"{p}/ready/{i}"
            if store.check([k]):
                _unseal(key, k, store.get(k))  # a forged word of readiness: Forged
                present.add(i)
        if len(present) == len(orders.members) or time.monotonic() >= deadline:
            store.compare_set(roster, "", _seal(key, roster, ",".join(map(str, sorted(present)))))
            break
        time.sleep(0.005)
    ranks = _unseal(key, roster, store.get(roster)).split(",")
    try:
        return tuple(orders.members[int(i)] for i in ranks)
    except (ValueError, IndexError):
        raise Forged(f"{roster}: not a roster") from None


def run(orders: Orders, announce: Callable[[str], None]) -> CollectiveLinks:
    """Runs the check as member *orders.rank*; the first member *announce*s its store."""
    from torch._C._distributed_c10d import TCPStore

    t0 = time.monotonic()
    members = orders.members
    first = orders.rank == 0
    timeout = timedelta(seconds=orders.stage_timeout * 4)
    if first:
        store = TCPStore(orders.host, 0, is_master=True, wait_for_workers=False,
                              timeout=timeout)  # fmt: skip
        host, port = orders.host, store.port
        announce(msgspec.json.encode(Serving(f"{orders.host}:{store.port}")).decode())
    else:
        host, _, at = orders.store.rpartition(":")
        host, port = host.strip("[]"), int(at)
        store = TCPStore(host, port, is_master=False, timeout=timeout)
    groups = _Groups(orders, lambda: TCPStore(host, port, is_master=False, timeout=timeout))
    trials: list[Trial] = []
    void = ""
    s = 0
    try:
        members = _roster(orders, store)
        ready = time.monotonic() - t0
    except Forged as err:
        members, void, ready = (), f"a forged roster in the link check's store: {err}", 0.0
    except (RuntimeError, OSError) as err:
        members, void, ready = (), f"lost the link check's store: {err}", 0.0
    step: TimeGroups | Found = Found() if void else next_step(members, trials, orders.limits)
    while isinstance(step, TimeGroups):
        if s >= MAX_STAGES:
            void = f"no conclusion after {MAX_STAGES} stages"
            break
        try:
            trials += _stage(orders, store, groups, s, step)
        except Forged as err:
            void = f"a forged timing in the link check's store: {err}"
            break
        except (RuntimeError, OSError) as err:  # the store went away (its host died)
            void = f"lost the link check's store: {err}"
            break
        s += 1
        step = next_step(members, trials, orders.limits)
    found = step if isinstance(step, Found) and not void else Found()
    try:
        if first:
            # The store lives in this process: give the others a moment to read the
            # last stage before it goes (they need nothing after that).
            done = [f"{orders.prefix}/done/{i}" for i in range(1, len(members))]
            until = time.monotonic() + orders.stage_timeout
            while done and time.monotonic() < until:
                done = [d for d in done if not store.check([d])]
                time.sleep(0.005)
        else:
            store.set(f"{orders.prefix}/done/{orders.rank}", "1")
    except (RuntimeError, OSError):
        pass  # a member gone by now changes nothing found
    return CollectiveLinks(
        members=members or orders.members,
        nodes=tuple(Blame(n.node, n.reason) for n in found.nodes),
        links=tuple(LinkBlame(x.a, x.b, x.reason) for x in found.links),
        stages=s,
        seconds=round(time.monotonic() - t0, 4),
        ready_s=round(ready, 4),
        void=void,
        backend=groups.backend,
    )


def main(argv: list[str]) -> int:
    if argv:
        # Gone with its launcher, even one that was SIGKILLed.
        pdeathsig_then_check(int(argv[0]))
    import torch  # noqa: F401  # the slow part, while the launcher still checks

    line = sys.stdin.buffer.readline(64 * 1024)
    try:
        orders = msgspec.json.decode(line, type=Orders)
    except msgspec.DecodeError as err:
        print(f"stalwart link check: bad orders: {err}", file=sys.stderr)
        return 2
    result = run(orders, lambda line: print(line, flush=True))
    print(msgspec.json.encode(result).decode(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
