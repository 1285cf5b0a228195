"""The gate a round asks before it closes: which of its joiners may not join.

`HealthGate` is the one object the rendezvous calls (through the `AdmissionGate`
protocol of ``rendezvous/gate.py``): before a node takes a slot it runs the node's
checks and leaves a signed report in the store (`before_join`); while the round is
open the closing node asks which joiners are refused (`refused`), writes the verdict
(`closing`), and after the close every node reads that verdict, logs and records each
exclusion, and learns whether it is out itself (`closed`). Every joiner goes through
one decision (``decision.admission``): its quarantine standing (when the job has a
quarantine, ``consult``), its own report and how it compares with its peers, and
whether its report came at all within ``HealthSettings.wait`` of its joining.

A job of one node has no store and no peers: `check_alone` runs its own checks and
nothing is compared.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec

from stalwart.base.events import Event
from stalwart.config import LaunchConfig
from stalwart.config.secret import job_secret
from stalwart.health import local, probe
from stalwart.health.decision import Admission, Candidate, Pending, Refuse, admission
from stalwart.health.guard import QuarantineGuard
from stalwart.health.judge import Limits, against_peers, slow_links
from stalwart.health.linkcheck import Forker, LinkCheck
from stalwart.health.records import (
    ID_LIMIT,
    MAX_LINKS,
    MAX_PROBLEMS,
    SEGMENTS_LIMIT,
    BadRecord,
    By,
    Exclusion,
    Link,
    NodeReport,
    Verdict,
    checked_count,
    checked_node,
    health_key,
    open_report,
    open_verdict,
    report_key,
    sign,
    verdict_key,
)
from stalwart.health.usercheck import run_user_check
from stalwart.rendezvous import Rendezvous
from stalwart.rendezvous.gate import Admissions

logger = logging.getLogger(__name__)

#: Seconds the collective link check may take at most, its process's start included.
LINK_BOUND = 30.0


class Store(Protocol):
    """What the gate needs of the rendezvous' key-value store."""

    def get(self, key: str) -> bytes | None: ...
    def get_many(self, keys: list[str]) -> list[bytes | None]: ...
    def set(self, key: str, value: str, *, leased: bool = False) -> None: ...
    def create(self, key: str, value: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...


@dataclass(frozen=True)
class HealthSettings:
    """This node's checks, as the launcher's settings give them."""

    command: str | None = None
    timeout: float = 30.0
    min_free: int = 256 * 2**20
    folders: tuple[Path, ...] = ()
    limits: Limits = field(default_factory=Limits)
    # Measure compute and links (off: only the floors and the user's check).
    measure: bool = True
    # Run checks at all (off: the gate only keeps quarantined nodes out).
    checks: bool = True
    # Seconds a joiner may stay without a report before it is kept out.
    wait: float = 60.0
    # Time the links in a collective check too (``linkcheck``), among up to this many
    # nodes (the job's MAX); 0: echo times only.
    collective: int = 0


@dataclass(frozen=True)
class OwnChecks:
    """What this node found of itself."""

    compute: float
    problems: tuple[str, ...]
    seconds: float


def own_checks(s: HealthSettings, addr: str | None) -> OwnChecks:
    """This node's checks; the user's command runs side by side with the compute burst."""
    t0 = time.monotonic()
    user: list[str | None] = [None]
    worker = None
    if s.command:
        cmd = s.command

        def run() -> None:
            user[0] = run_user_check(cmd, s.timeout)

        worker = threading.Thread(target=run, name="stalwart-health-check", daemon=True)
        worker.start()
    problems = local.disk_problems(s.folders, s.min_free)
    if (mem := local.memory_problem(s.min_free)) is not None:
        problems.append(mem)
    if addr is not None and (nic := local.interface_problem(addr)) is not None:
        problems.append(nic)
    rate = local.compute_rate() if s.measure else 0.0
    if worker is not None:
        worker.join()  # bounded: run_user_check kills the command at its timeout
        if user[0] is not None:
            problems.append(user[0])
    return OwnChecks(rate, tuple(problems[:MAX_PROBLEMS]), time.monotonic() - t0)


def _link(peer: str, echo: probe.Echo) -> Link:
    """A probed link as the report carries it (counts clamped to what a report may hold:
    a report that does not decode would be dropped whole)."""
    seg = echo.segments or probe.Segments(0, 0)
    sent = min(max(seg.sent, 0), SEGMENTS_LIMIT)
    return Link(peer, echo.seconds, sent=sent, resent=min(max(seg.resent, 0), sent))


Emit = Callable[..., Any]


@dataclass(frozen=True)
class Refusal:
    """This node is out before it joins: why, and whether the job goes on without it."""

    by: By
    line: str
    goes_on: bool


class HealthGate:
    """This node's side of the admission gate, over the rendezvous' store."""

    def __init__(
        self,
        settings: HealthSettings,
        key: bytes,
        run_id: str,
        emit: Emit | None = None,
        forker: Forker | None = None,
    ) -> None:
        self._s = settings
        # Forks the link check with torch imported (the warm template); None: cold.
        self._forker = forker
        self._key = key
        self._run_id = run_id
        self._emit = emit
        self._host = socket.gethostname()
        self._probe: probe.ProbeServer | None = None
        self._announced: set[int] = set()
        self._cache: dict[tuple[int, tuple[str, ...]], dict[str, NodeReport]] = {}
        self._dropped: set[str] = set()
        self._quarantine: QuarantineGuard | None = None
        self._silent: dict[tuple[int, str], float] = {}  # first seen without a report
        self._ready: LinkCheck | None = None  # a link check process started ahead

    def prepare(self) -> None:
        """Starts the first round's link check process now, so that it imports torch
        while the launcher starts up and joins the store (call from the thread that
        will check: its process dies with that thread)."""
        if self._ready is None:
            self._ready = self._new_link_check()

    def consult(self, quarantine: QuarantineGuard) -> None:
        """Keeps the nodes *quarantine* stands out of every round this node closes."""
        self._quarantine = quarantine

    # -- this node, before it joins ----------------------------------------------------
    def before_round(self, rdzv: Rendezvous, round_: int) -> Refusal | None:
        """What keeps this node itself out of *round_* before it even joins: its
        quarantine (it then leaves the job, ``QuarantineGuard.check``), or, in a job of
        one node, its own checks. Both are recorded here, once."""
        if self._quarantine is not None and (kept := self._quarantine.check(rdzv, round_)):
            w = kept.withdrawal
            return Refusal(By.QUARANTINE, w.line, goes_on=w.goes_on)
        if rdzv.elastic:
            return None  # the round's closer decides, in ``admissions``
        out = self.check_alone(round_)
        if out is None:
            return None
        self._excluded(round_, out, this_node=True)
        line = f"this node failed its health check before attempt {round_}: " + "; ".join(
            out.reasons
        )
        return Refusal(By.HEALTH_CHECK, line, goes_on=False)

    # -- one node ----------------------------------------------------------------------
    def check_alone(self, round_: int) -> Exclusion | None:
        """A node with no peers: its own checks only (nothing to compare compute with)."""
        if not self._s.checks:
            return None
        own = own_checks(self._s, None)
        self._checked(round_, own, log=False)  # the launcher's one-line error says it
        return Exclusion("this node", self._host, own.problems) if own.problems else None

    # -- before the node takes a slot --------------------------------------------------
    def before_join(
        self, kv: Store, round_: int, node: str, addr: str, peers: Sequence[str]
    ) -> None:
        """Runs the checks, times the links to the nodes that published before this one,
        and leaves the signed report for the node that closes the round.

        The report goes out twice: first without links (not ``final``: the round waits
        for the rest), then this node takes its place in the round's order, times a link
        to every node before it, takes part in the round's collective link check
        (``linkcheck``; its process was started first, to import torch meanwhile) and
        publishes again. Each pair is echo-timed by its later node, even when both check
        at once."""
        if not self._s.checks:
            return
        links_check = self._link_check()
        if links_check is not None:
            links_check.coming(kv, round_)
        try:
            listen_problem = None
            if self._probe is None and self._s.measure:
                try:
                    self._probe = probe.ProbeServer(addr)
                except OSError as err:  # peers could not reach its workers either
                    listen_problem = f"cannot listen on {addr}, its advertised address: {err}"
            own = own_checks(self._s, addr)
            if listen_problem is not None:
                problems = (listen_problem, *own.problems)[:MAX_PROBLEMS]
                own = OwnChecks(own.compute, problems, own.seconds)
            mine = NodeReport(
                run_id=self._run_id,
                round=round_,
                node=node,
                host=self._host,
                probe=self._probe.address if self._probe is not None else "",
                compute=own.compute,
                problems=own.problems,
                final=not self._s.measure,
            )
            kv.set(report_key(round_, node), sign(self._key, mine))
            t0 = time.monotonic()
            links: tuple[Link, ...] = ()
            collective = None
            if self._s.measure:
                i = kv.add(checked_count(round_), 1) - 1
                kv.set(checked_node(round_, i), node)
                first = max(0, i - MAX_LINKS)  # a forged count costs a bounded read
                names = kv.get_many([checked_node(round_, j) for j in range(first, i)])
                earlier = [n.decode(errors="replace")[:ID_LIMIT] for n in names if n is not None]
                others = [p for p in dict.fromkeys([*earlier, *peers]) if p != node]
                reports = self._reports(kv, round_, others)
                targets = [(p, r.probe) for p, r in reports.items() if r.probe]
                echoes = probe.time_links([a for _, a in targets])
                links = tuple(_link(p, e) for (p, _), e in zip(targets, echoes, strict=True))
                if links_check is not None:
                    collective = links_check.run(
                        kv, round_, node, addr, lambda ns: list(self._reports(kv, round_, ns))
                    )
                mine = msgspec.structs.replace(mine, links=links, collective=collective, final=True)
                kv.set(report_key(round_, node), sign(self._key, mine))
            more: dict[str, Any] = {}
            if collective is not None:
                more = {
                    "collective_s": collective.seconds,
                    "collective_ready_s": collective.ready_s,
                    "collective_stages": collective.stages,
                    "collective_void": collective.void,
                    "collective_backend": collective.backend,
                }
            if links_check is not None:
                # Where the link check's time went: its members' gathering, the wait for
                # its process to exist, and how it was started ("template" or "cold").
                more.update({f"collective_{k}": v for k, v in links_check.timing.items()})
            self._checked(
                round_,
                own,
                node=node,
                links=len(links),
                links_s=round(time.monotonic() - t0, 4),
                # What TCP resent on this node's probes (its links' loss, both ways).
                links_sent=sum(x.sent for x in links),
                links_resent=sum(x.resent for x in links),
                **more,
            )
        finally:
            if links_check is not None:
                links_check.stop()

    def _link_check(self) -> LinkCheck | None:
        """The collective link check of this round, started ahead (``prepare``) or now
        (its process imports torch while the node's other checks run); None: echo times
        only."""
        ready, self._ready = self._ready, None
        return ready if ready is not None else self._new_link_check()

    def _new_link_check(self) -> LinkCheck | None:
        if not self._s.checks or not self._s.measure or self._s.collective < 2:
            return None
        check = LinkCheck(
            self._key,
            self._run_id,
            expected=self._s.collective,
            limits=self._s.limits,
            # Below the round's wait for a report, with room for the other checks.
            bound=min(LINK_BOUND, self._s.wait / 2),
            forker=self._forker,
        )
        check.start()
        return check

    def _checked(self, round_: int, own: OwnChecks, log: bool = True, **more: object) -> None:
        if own.problems and log:
            logger.warning("health check before round %d: %s", round_, "; ".join(own.problems))
        if self._emit is not None:
            self._emit(
                Event.HEALTH_CHECKED,
                attempt=round_,
                seconds=round(own.seconds, 4),
                compute=round(own.compute, 1),
                problems=list(own.problems),
                **more,
            )

    # -- while the round is open -------------------------------------------------------
    def _reports(self, kv: Store, round_: int, nodes: Sequence[str]) -> dict[str, NodeReport]:
        """The valid reports of *nodes* for *round_*; forged, replayed or oversized ones
        are dropped (logged once per key)."""
        ids = tuple(nodes)
        cached = self._cache.get((round_, ids))
        if cached is not None:
            return cached
        keys = [report_key(round_, n) for n in ids]
        found: dict[str, NodeReport] = {}
        for n, k, raw in zip(ids, keys, kv.get_many(keys), strict=True):
            if raw is None:
                continue
            try:
                found[n] = open_report(self._key, raw, self._run_id, round_, n)
            except BadRecord as err:
                if k not in self._dropped:
                    self._dropped.add(k)
                    logger.warning("dropped the health report at %s: %s", k, err)
        if len(found) == len(ids) and all(r.final for r in found.values()):
            self._cache = {(round_, ids): found}  # final reports are written no more
        return found

    def _decided(
        self, kv: Store, round_: int, nodes: Sequence[str], running: Sequence[str] = ()
    ) -> dict[str, Admission]:
        """The admission of each of *nodes* in *round_* (``decision.admission``).
        *running*: the nodes of the round still under way; their reports for it are
        peers for the joiners' compute (their links and link checks were another
        round's). Without them a spare that checks while the others train has no peer
        to be slow against: it would look admissible, the job would restart to take it
        in, and the new round would keep it out again, round after round."""
        reports = self._reports(kv, round_, nodes) if self._s.checks else {}
        ref: list[NodeReport] = []
        others = [n for n in running if n not in reports]
        if self._s.checks and others and round_ > 0:
            ref = [
                msgspec.structs.replace(r, links=(), collective=None)
                for r in self._reports(kv, round_ - 1, others).values()
            ]
        peers = against_peers([*reports.values(), *ref], self._s.limits)
        standing = self._quarantine.standing(round_) if self._quarantine is not None else None
        now = time.monotonic()
        decided: dict[str, Admission] = {}
        for n in nodes:
            report = reports.get(n)
            done = report is not None and report.final
            since = now if done else self._silent.setdefault((round_, n), now)
            q = standing.of(n) if standing is not None else None
            c = Candidate(n, report, now - since, peers.get(n, ()), q.line() if q else None)
            decided[n] = admission(c, checks=self._s.checks, wait=self._s.wait)
        return decided

    def admissions(
        self, kv: Store, round_: int, nodes: Sequence[str], running: Sequence[str] = ()
    ) -> Admissions:
        """Which of *nodes* may not join *round_* (and why), and which are still due a
        report; *running*: the nodes of the round still under way (``_decided``)."""
        decided = self._decided(kv, round_, nodes, running)
        return Admissions(
            refused={n: "; ".join(d.reasons) for n, d in decided.items() if isinstance(d, Refuse)},
            pending=frozenset(n for n, d in decided.items() if isinstance(d, Pending)),
        )

    def refused(self, kv: Store, round_: int, nodes: Sequence[str]) -> Mapping[str, str]:
        """Which of *nodes* may not join *round_*, and why (one line each)."""
        return self.admissions(kv, round_, nodes).refused

    def closing(self, kv: Store, round_: int, nodes: Sequence[str]) -> None:
        """Before this node closes *round_* with the joiners *nodes*: the verdict every
        node will read (the first closer's wins, as with the round's slots)."""
        reports = self._reports(kv, round_, nodes) if self._s.checks else {}
        out = tuple(
            Exclusion(n, reports[n].host if n in reports else "", d.reasons[:MAX_PROBLEMS], d.by)
            for n, d in self._decided(kv, round_, nodes).items()
            if isinstance(d, Refuse)
        )
        slow = slow_links(reports.values(), [e.node for e in out], self._s.limits)
        verdict = Verdict(run_id=self._run_id, round=round_, excluded=out, slow_links=slow)
        kv.create(verdict_key(round_), sign(self._key, verdict))
        self._silent = {k: v for k, v in self._silent.items() if k[0] > round_}

    # -- after the close ---------------------------------------------------------------
    def closed(self, kv: Store, round_: int, node: str) -> str | None:
        """Reads the verdict of the closed *round_*: logs and records (once) every node
        it keeps out; returns why *node* is out, or None when it is in."""
        raw = kv.get(verdict_key(round_))
        if raw is None:
            return None  # closed by a node that checks nothing
        try:
            verdict = open_verdict(self._key, raw, self._run_id, round_)
        except BadRecord as err:
            logger.warning("dropped the health verdict of round %d: %s", round_, err)
            return None
        if round_ not in self._announced:
            self._announced.add(round_)
            for e in verdict.excluded:
                logger.warning(
                    "node %s (%s) is kept out of round %d: %s",
                    e.node,
                    e.host,
                    round_,
                    "; ".join(e.reasons),
                )
                self._excluded(round_, e, this_node=e.node == node)
            for link in verdict.slow_links:
                logger.warning("slow link in round %d: %s", round_, link)
        return next(("; ".join(e.reasons) for e in verdict.excluded if e.node == node), None)

    def _excluded(self, round_: int, e: Exclusion, *, this_node: bool) -> None:
        """The ``node_excluded`` event of a node kept out of *round_* by this gate."""
        if self._emit is not None:
            self._emit(
                Event.NODE_EXCLUDED,
                attempt=round_,
                node=e.node,
                host=e.host,
                reason="; ".join(e.reasons),  # as the other node_excluded events
                reasons=list(e.reasons),
                by=e.by.value,
                this_node=this_node,
            )

    def close(self) -> None:
        if self._ready is not None:
            self._ready.stop()
            self._ready = None
        if self._probe is not None:
            self._probe.close()
            self._probe = None


def gate_for(
    cfg: LaunchConfig, emit: Emit | None, run_dir: Path | None, forker: Forker | None = None
) -> HealthGate | None:
    """The gate *cfg* asks for: health checks, or a quarantine to keep nodes out by (it
    is ``consult``ed once the store is reached); None: neither. *forker*: the warm
    template, which forks the link check with torch imported."""
    secret = job_secret(cfg.job_secret_file, os.environ)
    quarantine = cfg.quarantine_after is not None and cfg.max_nodes > 1 and secret is not None
    if not cfg.health_checks and not quarantine:
        return None
    folders = tuple(p for p in (cfg.log_dir, run_dir) if p is not None) or (Path.cwd(),)
    settings = HealthSettings(
        command=cfg.node_health_check or None,
        timeout=cfg.node_health_timeout,
        min_free=cfg.node_health_min_free,
        folders=folders,
        # One node has no peers to compare a rate with: nothing to measure.
        measure=cfg.max_nodes > 1,
        collective=cfg.max_nodes if cfg.max_nodes > 1 else 0,
        checks=cfg.health_checks,
        wait=cfg.node_health_wait,
    )
    # Validated with the config: several nodes share a secret; one keeps its own.
    key = health_key(secret or secrets.token_bytes(32), cfg.run_id)
    gate = HealthGate(settings, key, cfg.run_id, emit, forker)
    gate.prepare()
    return gate
