"""The quarantine on one node: writes each failed round into the ledger, and before
each round says whether this node may join it.

``QuarantineGuard`` owns the ledger door and what this node has already announced; the
verdicts are ``quarantine``'s pure functions, the store is ``ledger``'s.  The supervisor
calls ``record`` after a failed round and ``check`` before joining the next one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stalwart.base.events import Event
from stalwart.config import LaunchConfig
from stalwart.config.secret import job_secret
from stalwart.health.ledger import Ledger, LedgerStore, ledger_key
from stalwart.health.quarantine import (
    Policy,
    Quarantine,
    Standing,
    Withdrawal,
    implicate,
    standing,
    withdrawal,
)
from stalwart.rendezvous import FailureRecord, Rendezvous

logger = logging.getLogger(__name__)

Emit = Callable[..., Any]


@dataclass(frozen=True)
class Kept:
    """This node is quarantined: what it does about it."""

    quarantine: Quarantine
    withdrawal: Withdrawal


class QuarantineGuard:
    def __init__(
        self,
        ledger: Ledger,
        policy: Policy,
        emit: Emit,
        *,
        min_nodes: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._ledger = ledger
        self._policy = policy
        self._emit = emit
        self._min_nodes = min_nodes
        self._clock = clock
        self._announced: set[tuple[str, int]] = set()  # (node, round) quarantines told
        self._released: set[tuple[str, int]] = set()

    def record(
        self, rdzv: Rendezvous, round_: int, node_rank: int, records: Sequence[FailureRecord]
    ) -> tuple[Quarantine, ...]:
        """Writes this node's account of failed round *round_* into the ledger; returns
        the quarantines that round brought about (a restart without their nodes may
        succeed where the same restart would not)."""
        entry = implicate(records, rdzv.node_names(round_), round_, self._clock())
        if entry is None:
            return ()
        self._ledger.write(node_rank, entry)
        verdict = standing(self._ledger.read(round_ + 1), self._policy, self._clock())
        return tuple(q for q in verdict.active if q.round == round_)

    def standing(self, round_: int) -> Standing:
        """Who is quarantined before round *round_*, as the ledger says now."""
        # A launcher yet to run a round may join the job late: it reads the whole ledger.
        ledger = self._ledger.read(round_) if round_ > 0 else self._ledger.read_all()
        return standing(ledger, self._policy, self._clock())

    def check(self, rdzv: Rendezvous, round_: int) -> Kept | None:
        """Before joining round *round_*: announces quarantines and releases not yet
        announced here; when this node is quarantined, leaves the job (``withdraw``) and
        says what the job does without it."""
        verdict = self.standing(round_)
        for q in verdict.active:
            if (q.node, q.round) not in self._announced:
                self._announced.add((q.node, q.round))
                self._emit(
                    Event.NODE_QUARANTINED,
                    attempt=round_ - 1,
                    node=q.node,
                    since_attempt=q.round,
                    until=q.until,
                    count=q.count,
                    window=q.window,
                    causes=[c.value for c in q.causes],
                    reason=q.line(),
                )
                logger.warning("%s", q.line())
        for q in verdict.released:
            if (q.node, q.round) not in self._released:
                self._released.add((q.node, q.round))
                self._emit(Event.NODE_RELEASED, node=q.node, since_attempt=q.round)
                logger.warning("node %s may join the job's rounds again", q.node)
        mine = verdict.of(rdzv.name)
        if mine is None:
            return None
        others = rdzv.withdraw() if rdzv.elastic else 0
        return Kept(
            mine, withdrawal(mine, elastic=rdzv.elastic, others=others, min_nodes=self._min_nodes)
        )


def guard_for(
    cfg: LaunchConfig, kv: LedgerStore | None, emit: Emit, environ: Mapping[str, str]
) -> QuarantineGuard | None:
    """The quarantine for this launcher, or None when it is off: ``--quarantine-after
    off``, a job of one node (no peer to compare with), no store, or no job secret
    (the ledger must be signed, or a stranger on the store could quarantine nodes)."""
    if cfg.quarantine_after is None or cfg.max_nodes < 2 or kv is None:
        return None
    secret = job_secret(cfg.job_secret_file, environ)
    if secret is None:
        logger.info(
            "node quarantine is off: it needs the job secret every node shares "
            "(STALWART_JOB_SECRET or --job-secret-file)"
        )
        return None
    after, window = cfg.quarantine_after
    return QuarantineGuard(
        Ledger(kv, ledger_key(secret, cfg.run_id), cfg.max_nodes),
        Policy(after, window, cfg.quarantine_for),
        emit,
        min_nodes=cfg.min_nodes,
    )
