"""The key-value contract the elastic rendezvous runs on, and its c10d ``TCPStore`` form.

Two engines back it: torch's ``TCPStore`` (hosted by one launcher: the embedded default)
and etcd (``rendezvous/etcd.py``: survives the loss of any launcher).  Both turn a lost
connection into ``StoreLost`` so the supervisor can stop its workers and say why.
"""

from __future__ import annotations

import atexit
import errno
import ipaddress
import logging
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec

from stalwart.base.sealed import Seal, SealError
from stalwart.rendezvous import keys
from stalwart.rendezvous.api import FailureRecord, RendezvousError, StoreLost, decode_failure

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

logger = logging.getLogger(__name__)

T = TypeVar("T")


class KV(Protocol):
    def get(self, key: str) -> bytes | None: ...

    def get_many(self, keys: list[str]) -> list[bytes | None]: ...

    def set(self, key: str, value: str, *, leased: bool = False) -> None:
        """*leased*: the key should vanish if this node dies (where the engine can)."""
        ...

    def create(self, key: str, value: str) -> bytes:
        """Writes *value* only if *key* is absent; returns the key's value afterwards."""
        ...

    def add(self, key: str, amount: int) -> int: ...

    def refresh(self) -> None:
        """Called on every keep-alive tick."""
        ...

    def close(self) -> None: ...


#: Seconds `C10dKV.close` waits for a store call in flight (a live store answers in
#: a millisecond; a dead host's refuses at once).
CLOSE_WAIT = 5.0


class C10dKV:
    """A ``TCPStore`` client (or the hosting server) seen through ``KV``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        is_host: bool,
        connect_timeout: float,
        op_timeout: float,
    ) -> None:
        from torch._C._distributed_c10d import TCPStore

        self.is_host = is_host
        try:
            if is_host:
                self.store: TCPStore = host_store(host, port, connect_timeout)
            else:
                self.store = TCPStore(
                    host,
                    port,
                    is_master=False,
                    wait_for_workers=False,
                    timeout=timedelta(seconds=connect_timeout),
                )
        except (RuntimeError, OSError) as err:
            what = "host" if is_host else "reach"
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise RendezvousError(
                f"cannot {what} the rendezvous store at {host}:{port} "
                f"(within {connect_timeout:g}s): {first}"
            ) from None
        self.host = host
        self.port = int(self.store.port)
        # A TCPStore call over a cut link blocks until TCP gives up (many minutes),
        # whatever the store's timeout says.  Calls therefore run on a helper thread and
        # the caller waits at most op_timeout; one that does not answer marks the store
        # lost for good (the stuck thread is a daemon and goes with the process).
        self._op_timeout = op_timeout
        self._broken: StoreLost | None = None
        self._timed_out = False
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        # Taken to queue a call and to close: no call is queued behind the close.
        self._queue_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="stalwart-c10d-kv", daemon=True)
        self._thread.start()
        # A daemon thread that comes back out of TCPStore's C++ code while the
        # interpreter finalizes is ended inside it, and the C++ runtime aborts the whole
        # process (SIGABRT, "terminate called without an active exception"): with the
        # store's host gone every call returns at once, so a keep-alive beat in flight
        # as the launcher exits did that. Closed before finalization, whatever path
        # the exit takes.
        atexit.register(_close_at_exit, weakref.ref(self))

    def _serve(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            fn, fut = item
            if self._broken is not None:  # queued before the failure: never sent
                fut.set_exception(self._broken.with_traceback(None))
                continue
            try:
                fut.set_result(fn())
            except BaseException as err:  # handed to the caller
                fut.set_exception(err)

    def _call(self, fn: Callable[[], T]) -> T:
        if self._broken is not None:
            # Without its old traceback: raised again at every beat, it would grow one.
            raise self._broken.with_traceback(None)
        fut: Future[T] = Future()
        with self._queue_lock:
            if self._closed:
                raise StoreLost(f"the c10d rendezvous store client for {self} is closed")
            self._calls.put((fn, fut))
        try:
            return fut.result(timeout=self._op_timeout)
        except TimeoutError:
            self._timed_out = True
            self._broken = StoreLost(
                f"the c10d rendezvous store at {self} did not answer within "
                f"{self._op_timeout:g}s (host down or network cut; with --rdzv-backend c10d "
                "the store's host is a single point of failure; etcd survives it)"
            )
            raise self._broken from None
        except RuntimeError as err:
            lost = self._lost(err)
            if _is_network_error(err):
                # torch's client never reconnects (measured: a new host on the same port
                # still answers "Broken pipe"), and each failed call formats the socket's
                # address through reverse DNS: a keep-alive beating a dead store floods
                # the resolver, calls then take its 5 s timeout, and one still inside
                # C++ as the interpreter exits aborts the process. One failure ends it.
                self._broken = lost
            raise lost from None

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    def _lost(self, err: Exception) -> StoreLost:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return StoreLost(
            f"lost the c10d rendezvous store at {self}: {first} (with --rdzv-backend c10d "
            "the store's host is a single point of failure; etcd survives it)"
        )

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        store = self.store

        def run() -> list[bytes | None]:
            # check() first: get() of a missing key would block until the store timeout.
            return [bytes(store.get(k)) if store.check([k]) else None for k in keys]

        return self._call(run)

    def set(self, key: str, value: str, *, leased: bool = False) -> None:
        self._call(lambda: self.store.set(key, value))

    def create(self, key: str, value: str) -> bytes:
        return self._call(lambda: bytes(self.store.compare_set(key, "", value)))

    def add(self, key: str, amount: int) -> int:
        return self._call(lambda: int(self.store.add(key, amount)))

    def refresh(self) -> None:
        """Nothing to renew: c10d liveness is the heartbeat counter itself."""

    def close(self) -> None:
        """Stops the thread that makes the store calls, after the call in flight (up to
        CLOSE_WAIT): later calls raise StoreLost without reaching the store. The store
        object itself goes with this launcher."""
        with self._queue_lock:
            if self._closed:
                return
            self._closed = True
            self._calls.put(None)
        if not self._timed_out:
            # A call that did not answer within op_timeout (a cut link) stays in TCP's
            # hands for minutes: waiting would not end it.
            self._thread.join(min(CLOSE_WAIT, self._op_timeout))


def _is_network_error(err: BaseException) -> bool:
    from torch.distributed import DistNetworkError

    return isinstance(err, DistNetworkError)


def _close_at_exit(ref: weakref.ref[C10dKV]) -> None:
    kv = ref()
    if kv is not None:
        kv.close()


#: The use the store's seal is derived for (``base.sealed.derive_key``).
STORE_LABEL = "stalwart-store/1"
#: Keys written in the clear: the run id is what a node compares before anything else,
#: so a node of another job (or with another secret) is told so in one line.
UNSEALED = frozenset({keys.RUN_ID})
#: Keys whose refused value is logged (once each); later ones only count.
_MAX_WARNED = 256


class SealedKV:
    """A ``KV`` whose values carry the job's MAC (``base.sealed``): every value written
    is sealed, every value read back opened, and one a stranger wrote (no MAC, a wrong
    one, or too large) reads as absent, logged once per key. Counters (``add``) cannot
    be sealed: what they steer is bounded by the sealed records they count."""

    def __init__(self, inner: KV, seal: Seal) -> None:
        self._inner = inner
        self._seal = seal
        self._warned: set[str] = set()
        self.refused = 0

    def __str__(self) -> str:
        return str(self._inner)

    def _open(self, key: str, raw: bytes | None) -> bytes | None:
        if raw is None or key in UNSEALED:
            return raw
        try:
            return self._seal.open(key, raw)
        except SealError as err:
            self.refused += 1
            if key not in self._warned and len(self._warned) < _MAX_WARNED:
                self._warned.add(key)
                logger.warning("refused the value at rendezvous store key %s: %s", key, err)
            return None

    def _close(self, key: str, value: str) -> str:
        if key in UNSEALED:
            return value
        return self._seal.close(key, value.encode()).decode()

    def get(self, key: str) -> bytes | None:
        return self._open(key, self._inner.get(key))

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return [self._open(k, v) for k, v in zip(keys, self._inner.get_many(keys), strict=True)]

    def set(self, key: str, value: str, *, leased: bool = False) -> None:
        self._inner.set(key, self._close(key, value), leased=leased)

    def create(self, key: str, value: str) -> bytes:
        # A stranger's value taken first reads as empty: the caller reads the key again
        # (and finds it absent) rather than acting on it.
        return self._open(key, self._inner.create(key, self._close(key, value))) or b""

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def refresh(self) -> None:
        self._inner.refresh()

    def close(self) -> None:
        self._inner.close()


class MemoryStore:
    """The data of a ``KV`` engine held in this process: several ``MemoryKV`` clients
    (nodes run as threads) share one.  For tests of the rendezvous logic, which then
    need no server, no root and no network namespace; it has no use across processes.

    *leases*: keys written ``leased=True`` vanish when their writer is cut off, as etcd's
    do when a lease expires (without it, as with c10d, a dead node's counter only stops)."""

    def __init__(self, *, leases: bool = False) -> None:
        self.leases = leases
        self.lock = threading.Lock()
        self.data: dict[str, bytes] = {}
        self.owner: dict[str, int] = {}  # leased key -> the client that wrote it


class MemoryKV:
    """One node's client of a ``MemoryStore``."""

    def __init__(self, store: MemoryStore, name: str = "memory") -> None:
        self._store = store
        self._name = name
        self._cut = False

    def __str__(self) -> str:
        return self._name

    def cut(self) -> None:
        """This node loses the store for good: every later call raises ``StoreLost`` (as
        from a dead host or a cut link), and with leases its leased keys vanish."""
        st = self._store
        with st.lock:
            self._cut = True
            if st.leases:
                for key in [k for k, who in st.owner.items() if who == id(self)]:
                    del st.data[key], st.owner[key]

    def _check(self) -> None:
        if self._cut:
            raise StoreLost(f"lost the in-memory rendezvous store {self._name}")

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        with self._store.lock:
            self._check()
            return [self._store.data.get(k) for k in keys]

    def set(self, key: str, value: str, *, leased: bool = False) -> None:
        st = self._store
        with st.lock:
            self._check()
            st.data[key] = value.encode()
            if leased:
                st.owner[key] = id(self)

    def create(self, key: str, value: str) -> bytes:
        with self._store.lock:
            self._check()
            return self._store.data.setdefault(key, value.encode())

    def add(self, key: str, amount: int) -> int:
        st = self._store
        with st.lock:
            self._check()
            total = int(st.data.get(key, b"0")) + amount
            st.data[key] = str(total).encode()
            return total

    def refresh(self) -> None:
        with self._store.lock:
            self._check()

    def close(self) -> None:
        """Nothing to release: the data belongs to the store."""


def bind_address(host: str, resolved: list[str]) -> str:
    """Where a store hosted for peers that reach it as *host* listens ("" = every interface).

    *resolved* are the addresses *host* names here.  A loopback name binds loopback: its
    peers are on this machine.  A name that only maps to loopback locally (Debian puts the
    machine's own name on 127.0.1.1) says nothing about the address peers use, so the
    store then listens everywhere, as torch's would."""
    if not resolved:
        return ""
    first = resolved[0]
    try:
        loopback = ipaddress.ip_address(first.split("%")[0]).is_loopback
    except ValueError:
        return ""
    if loopback and host not in ("localhost", first):
        return ""
    return first


def _resolve(host: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    # IPv4 first: torch's own clients try it first for a dual name such as localhost.
    addrs = [str(i[4][0]) for i in infos]
    return sorted(dict.fromkeys(addrs), key=lambda a: ":" in a)


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening socket for a store peers reach as *host*: bound to the address *host*
    names on this machine, not to every interface (``bind_address``)."""
    addr = bind_address(host, _resolve(host))
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr or "0.0.0.0", port))
        except OSError as err:
            if err.errno != errno.EADDRNOTAVAIL:
                raise
            # The name is not an address of this machine (a NAT or floating address).
            logger.warning("%s is not an address of this machine: listening on all", host)
            sock.bind(("0.0.0.0", port))
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


def host_store(host: str, port: int, timeout: float) -> TCPStore:
    """A ``TCPStore`` server that accepts connections only where *host* points.

    torch's server binds every interface whatever *host* says; handed an already bound
    socket (``master_listen_fd``, libuv and legacy backends alike) it listens there."""
    from torch._C._distributed_c10d import TCPStore

    sock = listen_socket(host, port)
    bound = str(sock.getsockname()[0])
    try:
        store = TCPStore(
            host if bound in ("0.0.0.0", "::") else bound,
            int(sock.getsockname()[1]),
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes the descriptor when it goes
    return store


def local_address_towards(host: str, port: int) -> str:
    """The address of the interface this machine uses to reach *host* (for peers)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP: resolves the route, sends nothing
            return str(s.getsockname()[0])
    except OSError:
        return socket.getfqdn()


def is_local_address(host: str) -> bool:
    """Whether *host* names this machine (one of its addresses binds)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
                return True
        except OSError:
            continue
    return False


def check_run_id(
    kv: KV, run_id: str, is_host: bool, timeout: float, where: str, external: bool = False
) -> None:
    """Makes sure the store belongs to job *run_id* (*external*: no launcher hosts it)."""
    # Only the host writes the id: a joiner that claimed an empty store could beat the
    # host to it, and the host would then reject its own job.
    if is_host:
        kv.set(keys.RUN_ID, run_id)
        return
    got: bytes | None = kv.create(keys.RUN_ID, run_id) if external else None
    deadline = time.monotonic() + timeout
    while got is None and (got := kv.get(keys.RUN_ID)) is None:
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"rendezvous {run_id}: timed out after {timeout:g}s waiting for the host "
                f"to publish the job's rendezvous id at {where}"
            )
        time.sleep(0.01)
    owner = got.decode(errors="replace")
    if owner != run_id:
        raise RendezvousError(
            f"rendezvous id mismatch at {where}: this node has --rdzv-id {run_id!r} but "
            f"the store belongs to job {owner[:80]!r}"
        )


def read_failures(
    kv: KV, round_: int, nodes: int, warned: set[str] | None = None
) -> list[FailureRecord]:
    """The failure records that nodes ``0..nodes-1`` wrote for *round_* (both backends).

    Anyone who can reach a c10d store can write to it: a record that does not parse, or
    names a node outside the round, is dropped and logged (once per key in *warned*)."""
    out = []
    names = [keys.Round(round_).failure(i) for i in range(nodes)]
    for key, raw in zip(names, kv.get_many(names), strict=True):
        if raw is None:
            continue
        try:
            rec = decode_failure(raw)
            if not 0 <= rec.node_rank < nodes:
                raise ValueError(f"node_rank {rec.node_rank} outside 0..{nodes - 1}")
        except (msgspec.DecodeError, ValueError) as err:
            if warned is None or key not in warned:
                logger.warning("dropped a malformed failure record at %s: %s", key, err)
                if warned is not None:
                    warned.add(key)
            continue
        out.append(rec)
    return out


def parse_count(raw: bytes | None, key: str) -> int:
    """A node's worker count from the store: a positive integer, or a one-line error."""
    text = (raw or b"").decode(errors="replace")
    if not text.isdigit() or int(text) < 1:
        raise RendezvousError(f"rendezvous store key {key} holds {text[:40]!r}: expected a count")
    return int(text)


def parse_address(raw: bytes | None, key: str) -> tuple[str, int]:
    """``host:port`` from the store, validated, or a one-line error."""
    text = (raw or b"").decode(errors="replace")
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RendezvousError(f"rendezvous store key {key} holds {text[:80]!r}: expected HOST:PORT")
    return host, int(port)
