"""Elastic rendezvous: ``MIN:MAX`` nodes, keep-alive, node loss and spare nodes.

All state lives in a ``KV`` engine (c10d ``TCPStore``, etcd, or memory for tests), under
the keys ``rendezvous/keys.py`` names:

* ``r<n>/joined`` counter hands out slots; ``r<n>/node/<slot>`` describes the node;
* ``r<n>/closed`` is written once (create-if-absent, so the first closer wins) with the
  admitted slots in rank order: every node reads the same decision;
* ``r<n>/failed``, ``r<n>/failure/<group rank>``, ``r<n>/done`` end the round;
* ``hb/<node id>`` is each node's keep-alive counter, bumped by a thread.  A member whose
  counter stops moving for ``keep_alive_interval × keep_alive_max_attempt`` is lost (with
  etcd the key also hangs off a lease and vanishes).  Counters, not timestamps, so
  clocks of different hosts need not agree.

A round may close when the previous one is over (round 0, or ``r<n-1>/failed``) and
either MAX nodes joined, or at least MIN did and every live member of the previous round
is back, or at least MIN did and nobody new arrived for ``last_call_timeout``.  A node
that arrives while the job runs joins the next round and waits there: a spare, admitted
at the next restart boundary.  Ranks: survivors keep their order, newcomers follow.
That rule is ``close_rule.close_rule``, a pure function of a ``CloseView`` (what a node
reads of the store and the keep-alives); the records read from the store and the
nodes' liveness are in ``members.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from stalwart.base.sealed import Seal
from stalwart.rendezvous import close_rule as rule
from stalwart.rendezvous import keys
from stalwart.rendezvous.api import (
    FailureRecord,
    JobEnded,
    NodeExcluded,
    NodeLost,
    RendezvousError,
    RendezvousInfo,
    StoreLost,
    bounded_failure,
)
from stalwart.rendezvous.gate import AdmissionGate
from stalwart.rendezvous.kv import (
    KV,
    STORE_LABEL,
    SealedKV,
    host_store,
    parse_address,
    read_failures,
)
from stalwart.rendezvous.members import JobEnd, Liveness, Member, decode_or_none, node_name

logger = logging.getLogger(__name__)


_POLL = 0.02
# A spare may wait for hours: a few store reads a second are plenty.
_SPARE_POLL = 0.25


@dataclass
class _Opening:
    """What ``_await_close`` remembers between two looks at the store."""

    last_arrival: float  # when the joined counter last moved
    joined: int = -1
    opened: float | None = None  # when the previous round ended (this one opened)
    members: dict[int, Member] = field(default_factory=dict)  # by slot, read so far
    spare_logged: bool = False
    refused: dict[str, str] = field(default_factory=dict)  # by node id: why (the gate)


class ElasticRendezvous:
    """Node membership for one job, on a ``KV`` engine shared by all its launchers."""

    elastic = True

    def __init__(
        self,
        kv: KV,
        settings: rule.ElasticSettings,
        *,
        run_id: str,
        local_addr: str,
        rank_hint: int | None = None,
        backend: str = "c10d",
        hosts_store: bool = False,
        seal: Seal | None = None,
        gate: AdmissionGate | None = None,
    ) -> None:
        # Job end, failures, members, closes, addresses, keep-alives: sealed.
        self.kv: KV = SealedKV(kv, seal if seal is not None else Seal(None, STORE_LABEL))
        # Asked before this node takes a slot and before a round closes (health checks).
        self._gate = gate
        self.settings = settings
        self.run_id = run_id
        self.backend = backend
        self.node_rank: int | None = rank_hint
        self.local_addr = local_addr
        self.id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._hint = rank_hint
        self._hosts_store = hosts_store
        self._members: dict[int, list[Member]] = {}
        self._worker_stores: dict[int, Any] = {}
        self._live = Liveness(kv, settings.lost_after)
        self._last_check = 0.0
        self._spares_seen: tuple[float, int] = (0.0, 0)  # (when, answer) of `waiting`
        self._beat_ok = time.monotonic()
        self._stop = threading.Event()
        self._warned: set[str] = set()
        self._counter_warned: set[int] = set()  # rounds whose joined counter was forged
        self._excluded = False  # a rank asked to take this node out of the job
        self._interrupted = threading.Event()
        ended = self._ended()
        if ended is not None:
            raise RendezvousError(
                f"rendezvous id {run_id!r} at {backend} {kv} belongs to a job that already "
                f"ended ({ended.reason or '?'}); use a new --rdzv-id"
            )
        self._beat()
        self._thread = threading.Thread(
            target=self._keep_alive, name="stalwart-keepalive", daemon=True
        )
        self._thread.start()

    # -- keep-alive --------------------------------------------------------------------
    def _beat(self) -> None:
        n = int(time.monotonic() * 1000)
        self.kv.refresh()  # first: an expired lease is re-granted before the leased write
        self.kv.set(keys.heartbeat(self.id), str(n), leased=True)
        self._beat_ok = time.monotonic()

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.settings.keep_alive_interval):
            try:
                self._beat()
            except Exception as err:  # the thread must outlive any one failed beat
                logger.warning("keep-alive to the rendezvous store failed: %s", err)

    def _check_cut_off(self) -> None:
        silent = time.monotonic() - self._beat_ok
        if silent > self.settings.lost_after + self.settings.keep_alive_interval:
            raise StoreLost(
                f"this node could not reach the rendezvous store ({self.backend} at "
                f"{self.kv}) for {silent:.1f}s; the others count it as lost, so it stops"
            )

    # -- joining -----------------------------------------------------------------------
    def _first_open(self, r: int) -> int:
        while self.kv.get(keys.Round(r).closed) is not None:
            r += 1
        return r

    def _closed(self, r: int, raw: bytes) -> list[int]:
        """The admitted slots of round *r*: every node acts on the same list, so one that
        does not parse stops the job (one line) rather than being guessed at."""
        try:
            return msgspec.json.decode(raw, type=list[Annotated[int, msgspec.Meta(ge=0)]])
        except msgspec.DecodeError as err:
            raise RendezvousError(
                f"rendezvous {self.run_id}: store key {keys.Round(r).closed} holds "
                f"{raw[:80].decode(errors='replace')!r}: {err}"
            ) from None

    def _member(self, key: str, raw: bytes | None) -> Member | None:
        return None if raw is None else decode_or_none(raw, Member, key, self._warned)

    def _members_of(self, r: int) -> list[Member]:
        if r not in self._members:
            k = keys.Round(r)
            raw = self.kv.get(k.closed)
            if raw is None:
                return []
            names = [k.node(s) for s in self._closed(r, raw)]
            recs = [self._member(n, x) for n, x in zip(names, self.kv.get_many(names), strict=True)]
            self._members[r] = [m for m in recs if m is not None]
        return self._members[r]

    def _ended(self) -> JobEnd | None:
        raw = self.kv.get(keys.JOB_ENDED)
        return None if raw is None else decode_or_none(raw, JobEnd, keys.JOB_ENDED, self._warned)

    def _check_ended(self) -> None:
        ended = self._ended()
        if ended is not None:
            raise JobEnded(ended.succeeded, ended.reason, ended.exit_code)

    def join(self, round_: int, local_world_size: int) -> RendezvousInfo:
        t0 = time.monotonic()
        r = round_
        while True:
            r = self._first_open(r)
            if r > self.settings.max_restarts:
                raise RendezvousError(
                    f"rendezvous {self.run_id}: the job has used its restart budget "
                    f"({self.settings.max_restarts}); this node is not needed"
                )
            # A spare kept out of the last round comes back here at once: when the job
            # ended meanwhile, no round follows, and a check now would wait out its bound
            # for peers that are gone (the store's host waiting for it to leave).
            self._check_ended()
            prev = self._members.get(r - 1, [])
            hint = next((i for i, m in enumerate(prev) if m.id == self.id), self._hint)
            me = Member(self.id, socket.gethostname(), self.local_addr, local_world_size, hint)
            slot = self.kv.add(keys.Round(r).joined, 1) - 1
            self.kv.set(keys.Round(r).node(slot), me.encode())
            if self._gate is not None:
                # After taking the slot: the round knows this node is coming and waits
                # for its report only as long as the gate's bound, not for its whole start.
                self._gate.before_join(self.kv, r, self.id, self.local_addr, self._joined_ids(r))
            try:
                order = self._await_close(r)
            except JobEnded:
                self._announce_if_closed(r)
                raise
            out = None if self._gate is None else self._gate.closed(self.kv, r, self.id)
            if slot not in order:
                if out is not None:
                    logger.warning(
                        "this node is kept out of round %d (%s); it checks again before "
                        "the next round",
                        r,
                        out,
                    )
                else:
                    logger.info("round %d is full (%d nodes); waiting as a spare", r, len(order))
                r += 1
                continue
            members = self._members_of(r)
            group_rank = order.index(slot)
            self.node_rank = group_rank
            if group_rank == 0:
                self._open_worker_store(r)
            master = self._await_master(r, members)
            if master is not None:
                break
            r += 1  # node 0 died before it published the workers' store: next round
        addr, port = parse_address(master, keys.Round(r).master)
        sizes = [m.nproc for m in members]
        now_ids = {m.id for m in members}
        left = tuple(
            f"{m.host} (node rank {i}, {m.addr})"
            for i, m in enumerate(self._members.get(r - 1, []))
            if m.id not in now_ids
        )
        return RendezvousInfo(
            round=r,
            group_rank=group_rank,
            group_world_size=len(members),
            base_rank=sum(sizes[:group_rank]),
            world_size=sum(sizes),
            master_addr=addr,
            master_port=port,
            duration=time.monotonic() - t0,
            left=left,
        )

    def _announce_if_closed(self, r: int) -> None:
        """The job ended while this node waited for round *r* to close. The round may
        have closed between two reads of the wait (a lossy link delays an answer past
        the whole short job): what its verdict says of the nodes, this one included,
        is still logged and recorded here, or a node kept out would never say why."""
        if self._gate is None:
            return
        with contextlib.suppress(RendezvousError):
            if self.kv.get(keys.Round(r).closed) is not None:
                self._gate.closed(self.kv, r, self.id)

    def _slots_taken(self, r: int) -> int:
        """Round *r*'s joined counter, bounded: the counter is a plain store number
        (``add`` cannot be sealed), and a stranger who raised it to 10**9 must not make
        every node read 10**9 keys each poll.  Past the bound the nodes beyond it are
        not seen, and the round closes without them or times out with one line."""
        n = self.kv.add(keys.Round(r).joined, 0)
        bound = 8 * self.settings.max_nodes + 64
        if n > bound:
            if r not in self._counter_warned:
                self._counter_warned.add(r)
                logger.warning(
                    "round %d's joined counter reads %d, more than %d launchers could "
                    "take (8 x max nodes + 64): someone else wrote it; reading %d slots",
                    r,
                    n,
                    bound,
                    bound,
                )
            return bound
        return max(n, 0)

    def _joined_ids(self, r: int) -> list[str]:
        """The nodes that took a slot in round *r* so far."""
        k = keys.Round(r)
        names = [k.node(i) for i in range(self._slots_taken(r))]
        recs = [self._member(n, x) for n, x in zip(names, self.kv.get_many(names), strict=True)]
        return [m.id for m in recs if m is not None]

    def _await_master(self, r: int, members: list[Member]) -> bytes | None:
        """The workers' store address node 0 publishes; None if node 0 was lost first."""
        deadline = time.monotonic() + self.settings.join_timeout
        while (master := self.kv.get(keys.Round(r).master)) is None:
            self._check_cut_off()
            if members[0].id != self.id:
                self._live.observe([members[0].id])
                if self._lost_member(r, 0, members[0]):
                    return None
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"rendezvous {self.run_id}: node 0 of round {r} did not publish the "
                    f"workers' store within {self.settings.join_timeout:g}s"
                )
            time.sleep(_POLL)
        return master

    def _lost_member(self, r: int, rank: int, m: Member) -> bool:
        """If *m* (node *rank* of round *r*) is lost, fails round *r* on its behalf."""
        silent = self._live.lost(m.id)
        if silent is None:
            return False
        logger.warning("node %d (%s) lost: no keep-alive for %.1fs", rank, m.host, silent)
        self.report_failure(
            r,
            NodeLost(
                node_rank=rank,
                host=m.host,
                reason=f"node {rank} ({m.host}) lost: no keep-alive for {silent:.1f}s",
            ),
        )
        return True

    def _expected(self, r: int) -> set[str] | None:
        """Ids of the previous round's members that are still alive and have not left
        (an excluded node leaves at once) (None for round 0)."""
        if r == 0:
            return None
        prev = self._members_of(r - 1)
        self._live.observe([m.id for m in prev])
        gone = self.kv.get_many([keys.left(m.id) for m in prev])
        return {
            m.id
            for m, g in zip(prev, gone, strict=True)
            if g is None and self._live.lost(m.id) is None
        }

    def _await_close(self, r: int) -> list[int]:
        """Waits until round *r* is closed (by this node or another); returns its slots.
        Each look: read a view of the store, apply ``close_rule``, act on its answer."""
        k = keys.Round(r)
        opening = _Opening(last_arrival=time.monotonic())
        while True:
            raw = self.kv.get(k.closed)
            if raw is not None:
                return self._closed(r, raw)
            self._check_cut_off()
            self._check_ended()
            match rule.close_rule(self._close_view(r, opening), self.settings):
                case rule.Close(slots):
                    if self._gate is not None:
                        ids = [m.id for _, m in sorted(opening.members.items())]
                        self._gate.closing(self.kv, r, ids)
                    # Create-if-absent: the first closer wins, and everyone reads its list.
                    self.kv.create(k.closed, json.dumps(list(slots)))
                case rule.TooFewAdmitted(admitted, refused):
                    why = "; ".join(f"{n}: {opening.refused.get(n, '?')}" for n in refused)
                    raise RendezvousError(
                        f"rendezvous {self.run_id}: round {r} cannot form: {admitted} node(s) "
                        f"passed the admission checks, at least {self.settings.min_nodes} "
                        f"needed; kept out: {why}"
                    )
                case rule.TimedOut(live):
                    raise RendezvousError(
                        f"rendezvous {self.run_id}: only {live} of at least "
                        f"{self.settings.min_nodes} node(s) joined round {r} within "
                        f"{self.settings.join_timeout:g}s"
                    )
                case rule.WatchRunning():
                    self._watch_running(r, opening)
                    time.sleep(_SPARE_POLL)
                case rule.Wait():
                    time.sleep(_POLL)

    def _close_view(self, r: int, opening: _Opening) -> rule.CloseView:
        """Round *r* as the close rule sees it, from the store and the keep-alives."""
        k = keys.Round(r)
        now = time.monotonic()
        n = self._slots_taken(r)
        if n != opening.joined:
            opening.joined, opening.last_arrival = n, now
        if r > 0 and self.kv.get(keys.Round(r - 1).failed) is None:
            return rule.CloseView(previous_running=True)
        if opening.opened is None:
            # Last call counts from the moment the round opened, not from when a spare
            # arrived (maybe hours ago), or it would close alone at once.
            opening.opened = opening.last_arrival = now
        missing = [i for i in range(n) if i not in opening.members]
        for i, raw in zip(missing, self.kv.get_many([k.node(i) for i in missing]), strict=True):
            if (new := self._member(k.node(i), raw)) is not None:
                opening.members[i] = new
        members = sorted(opening.members.items())
        self._live.observe([m.id for _, m in members])
        gone = self.kv.get_many([keys.left(m.id) for _, m in members])
        pending: frozenset[str] = frozenset()
        if self._gate is not None:
            said = self._gate.admissions(self.kv, r, [m.id for _, m in members])
            opening.refused, pending = dict(said.refused), said.pending
        joiners = self._joiners(members, gone, opening.refused, pending)
        expected = self._expected(r)
        return rule.CloseView(
            previous_running=False,
            joiners=joiners,
            expected=None if expected is None else frozenset(expected),
            quiet_for=now - opening.last_arrival,
            open_for=now - opening.opened,
        )

    def _watch_running(self, r: int, opening: _Opening) -> None:
        if not opening.spare_logged:
            opening.spare_logged = True
            logger.info(
                "round %d is running without this node: waiting as a spare for the next restart",
                r - 1,
            )
        prev = self._members_of(r - 1)
        self._live.observe([m.id for m in prev])
        for rank, m in enumerate(prev):
            if self._lost_member(r - 1, rank, m):
                break

    def _open_worker_store(self, r: int) -> None:
        self._worker_stores.clear()  # a straggler of a dead round cannot reach the new one
        # Listens on the address this node advertises, not on every interface.
        store = host_store(self.local_addr, 0, self.settings.join_timeout)
        self._worker_stores[r] = store
        self.kv.set(keys.Round(r).master, f"{self.local_addr}:{store.port}")

    # -- the running round -------------------------------------------------------------
    def report_failure(self, round_: int, failure: FailureRecord) -> None:
        rank = failure.node_rank
        if isinstance(failure, NodeExcluded) and rank == self.node_rank:
            self._excluded = True
        self.kv.set(keys.Round(round_).failure(rank), bounded_failure(failure).encode().decode())
        self.kv.create(keys.Round(round_).failed, str(rank))

    def failed(self, round_: int) -> bool:
        self._check_cut_off()
        # A node writes its record before the flag: a flag without a valid record fails
        # nothing (it is garbage, or a stranger's).
        if self.kv.get(keys.Round(round_).failed) is not None and self.failures(round_):
            return True
        now = time.monotonic()
        if now - self._last_check < self.settings.keep_alive_interval / 4:
            return False
        self._last_check = now
        members = self._members_of(round_)
        self._live.observe([m.id for m in members])
        return any(
            m.id != self.id and self._lost_member(round_, rank, m) for rank, m in enumerate(members)
        )

    def failures(self, round_: int) -> list[FailureRecord]:
        return read_failures(self.kv, round_, len(self._members_of(round_)), self._warned)

    def waiting(self, round_: int) -> int:
        now = time.monotonic()
        seen_at, answer = self._spares_seen
        # A few looks a second, as for a lost node: a grow can wait that long.
        if now - seen_at < self.settings.keep_alive_interval / 4:
            return answer
        answer = self._admissible(round_)
        self._spares_seen = (now, answer)
        return answer

    def _admissible(self, round_: int) -> int:
        running = frozenset(m.id for m in self._members_of(round_))
        if not running or len(running) >= self.settings.max_nodes:
            return 0
        k = keys.Round(round_ + 1)
        n = self._slots_taken(round_ + 1)  # one store call while nobody waits
        if n == 0:
            return 0
        names = [k.node(i) for i in range(n)]
        found = [
            self._member(key, raw) for key, raw in zip(names, self.kv.get_many(names), strict=True)
        ]
        members = [(slot, m) for slot, m in enumerate(found) if m is not None]
        ids = [m.id for _, m in members]
        self._live.observe(ids)
        gone = self.kv.get_many([keys.left(i) for i in ids])
        said = (
            self._gate.admissions(self.kv, round_ + 1, ids, running=sorted(running))
            if self._gate
            else None
        )
        refused = said.refused if said else {}
        pending = said.pending if said else frozenset()
        spares = self._joiners(members, gone, refused, pending)
        return rule.admissible_spares(running, spares, self.settings)

    def _joiners(
        self,
        members: Sequence[tuple[int, Member]],
        gone: Sequence[bytes | None],
        refused: Mapping[str, str],
        pending: frozenset[str],
    ) -> tuple[rule.Joiner, ...]:
        """The close rule's view of the nodes in a round's slots: alive by their
        keep-alive, left by their own word, refused or pending by the admission gate."""
        return tuple(
            rule.Joiner(
                slot,
                m.id,
                m.hint,
                alive=self._live.lost(m.id) is None,
                left=g is not None,
                refused=m.id in refused,
                pending=m.id in pending,
            )
            for (slot, m), g in zip(members, gone, strict=True)
        )

    @property
    def name(self) -> str:
        return node_name(socket.gethostname(), self.local_addr)

    def node_names(self, round_: int) -> tuple[str, ...]:
        return tuple(node_name(m.host, m.addr) for m in self._members_of(round_))

    def withdraw(self) -> int:
        """Leaves the job for good before the next round: says so in the store at once
        (the next round closes without waiting for this node) and, hosting the c10d
        store, keeps serving it on ``leave``.  Returns how many other nodes are still in
        the job: alive, not left, spares waiting included."""
        self._excluded = True
        self.kv.set(keys.left(self.id), "1")
        others = [i for i in self._registered() if i != self.id]
        self._live.observe(others)
        gone = self.kv.get_many([keys.left(i) for i in others])
        return sum(
            1 for i, g in zip(others, gone, strict=True) if g is None and self._live.lost(i) is None
        )

    def report_done(self, round_: int) -> None:
        # One key per node, not a counter: a retried etcd transaction could count twice.
        if self.node_rank is None:
            raise RuntimeError("report_done() before join()")
        self.kv.set(keys.Round(round_).done(self.node_rank), "1")

    def all_done(self, round_: int) -> bool:
        n = len(self._members_of(round_))
        return all(
            v is not None for v in self.kv.get_many([keys.Round(round_).done(i) for i in range(n)])
        )

    def finish(self, succeeded: bool, reason: str, exit_code: int | None = None) -> None:
        try:
            end = JobEnd(succeeded, reason, exit_code)
            self.kv.create(keys.JOB_ENDED, msgspec.json.encode(end).decode())
        except RendezvousError as err:
            logger.debug("finish(): %s", err)

    def leave(self) -> None:
        """Stops the keep-alive; the c10d store's host waits (``close_timeout``) until every
        registered node has left or is lost, since its exit takes the store with it."""
        try:
            self.kv.set(keys.left(self.id), "1")
            if self._hosts_store and self._excluded:
                self._serve_until_the_end()
            self._stop.set()
            if self._hosts_store:
                deadline = time.monotonic() + self.settings.close_timeout
                while time.monotonic() < deadline:
                    if self._all_gone(self._registered()):
                        break
                    if self._interrupted.wait(0.05):
                        logger.warning("interrupted while waiting for the other nodes to leave")
                        break
                else:
                    logger.warning("not every node left within %ss", self.settings.close_timeout)
        except RendezvousError as err:  # the store may already be gone
            logger.debug("leave(): %s", err)
        self._stop.set()
        self.kv.close()
        self._worker_stores.clear()

    def _serve_until_the_end(self) -> None:
        """An excluded node that hosts the c10d store: its workers are gone, but the
        others' rendezvous runs on its store, so it keeps serving (and beating) until
        the job ends or every other node has left or is lost."""
        logger.warning(
            "this node is out of job %s but hosts its c10d store: serving it until the job ends",
            self.run_id,
        )
        while self._ended() is None and not self._interrupted.is_set():
            if self._all_gone([i for i in self._registered() if i != self.id]):
                return
            self._interrupted.wait(_SPARE_POLL)

    def _all_gone(self, ids: list[str]) -> bool:
        """Every node of `ids` has said it left the job, or is lost."""
        self._live.observe(ids)
        gone = self.kv.get_many([keys.left(i) for i in ids])
        return all(
            g is not None or self._live.lost(i) is not None for i, g in zip(ids, gone, strict=True)
        )

    def interrupt(self) -> None:
        """A signal reached the exiting launcher: stop serving the store for the others."""
        self._interrupted.set()

    def _registered(self) -> list[str]:
        # Every node that ever joined a round, spares included.
        ids: set[str] = set()
        r = 0
        while True:
            k = keys.Round(r)
            n = self._slots_taken(r)
            if n == 0:
                break
            names = [k.node(i) for i in range(n)]
            for key, raw in zip(names, self.kv.get_many(names), strict=True):
                if (m := self._member(key, raw)) is not None:
                    ids.add(m.id)
            r += 1
        return sorted(ids)
