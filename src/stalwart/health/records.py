"""What a node's health check leaves in the store, and the verdict of a round.

Both are JSON records signed with a key derived from the job's secret (which never
passes through the store): anyone who reaches the store's port can write a key, so a
reader drops a record whose MAC does not match, that names another job, round or node
than its key, or that exceeds the sizes below. The store keys are spelled here only.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from typing import Annotated, TypeVar

import msgspec

#: Largest signed record read back from the store (bytes): a report with MAX_LINKS links
#: of ID_LIMIT-character ids fits; anything larger is not ours.
RECORD_LIMIT = 256 * 1024
#: Text of one problem a check found (characters).
PROBLEM_LIMIT = 512
MAX_PROBLEMS = 8
#: Links a report may carry: one per peer, a job of up to this many nodes.
MAX_LINKS = 1024
ID_LIMIT = 128
#: More TCP segments than one link probe could send, even resent many times over.
SEGMENTS_LIMIT = 1 << 20

_Id = Annotated[str, msgspec.Meta(max_length=ID_LIMIT)]
_Problem = Annotated[str, msgspec.Meta(max_length=PROBLEM_LIMIT)]
_Seconds = Annotated[float, msgspec.Meta(ge=0.0)]
_Segments = Annotated[int, msgspec.Meta(ge=0, le=SEGMENTS_LIMIT)]


def report_key(round_: int, node: str) -> str:
    return f"health/r{round_}/report/{node}"


def checked_count(round_: int) -> str:
    """Counts the nodes that published a report for the round (hands out the order)."""
    return f"health/r{round_}/count"


def checked_node(round_: int, i: int) -> str:
    """The node id that published the *i*-th report of the round."""
    return f"health/r{round_}/who/{i}"


def verdict_key(round_: int) -> str:
    return f"health/r{round_}/verdict"


def link_coming(round_: int) -> str:
    """Counts the nodes that started checking for the round (they will come to its
    collective link check once their own checks are done)."""
    return f"health/r{round_}/links/coming"


def link_count(round_: int) -> str:
    """Counts the nodes that came to the round's collective link check."""
    return f"health/r{round_}/links/count"


def link_node(round_: int, i: int) -> str:
    """The node id that came *i*-th to the round's collective link check."""
    return f"health/r{round_}/links/who/{i}"


def link_plan_key(round_: int) -> str:
    """The members of the round's collective link check (the first sealer's list wins)."""
    return f"health/r{round_}/links/plan"


def link_store_key(round_: int) -> str:
    """Where the check's first member serves the store its process groups meet on."""
    return f"health/r{round_}/links/store"


class Link(msgspec.Struct, frozen=True):
    """The best time of a small echo to *peer* (seconds; None: it could not be reached),
    and the data segments TCP sent on the probe's connection, both ways, and resent of
    them (0 and 0: not counted)."""

    peer: _Id
    seconds: _Seconds | None
    sent: _Segments = 0
    resent: _Segments = 0


class Blame(msgspec.Struct, frozen=True):
    """A node the collective link check found slow or broken, and why."""

    node: _Id
    reason: _Problem


class LinkBlame(msgspec.Struct, frozen=True):
    """A link between two nodes the collective link check found slow or broken."""

    a: _Id
    b: _Id
    reason: _Problem


class CollectiveLinks(msgspec.Struct, frozen=True, kw_only=True):
    """What one member of the round's collective link check concluded
    (``linksplit.next_step``'s last answer): every member runs the same decision over
    the same timings, so their conclusions agree unless one was cut off."""

    members: Annotated[tuple[_Id, ...], msgspec.Meta(max_length=MAX_LINKS)]
    nodes: Annotated[tuple[Blame, ...], msgspec.Meta(max_length=MAX_LINKS)] = ()
    links: Annotated[tuple[LinkBlame, ...], msgspec.Meta(max_length=MAX_LINKS)] = ()
    stages: Annotated[int, msgspec.Meta(ge=0)] = 0
    seconds: _Seconds = 0.0
    # Of *seconds*, the wait until its members were ready (the roster): the slowest
    # member's start-up, not the links.
    ready_s: _Seconds = 0.0
    # Why it concluded nothing ("": it ran to the end): a forged record, a timeout.
    void: _Problem = ""
    backend: Annotated[str, msgspec.Meta(max_length=16)] = ""  # "gloo" or "nccl"


class NodeReport(msgspec.Struct, frozen=True, kw_only=True):
    """One node's health check before *round*."""

    run_id: _Id
    round: Annotated[int, msgspec.Meta(ge=0)]
    node: _Id
    host: _Id
    probe: _Id = ""  # "addr:port" of its echo server; "": none
    # Matrix products per second in the best of a few short bursts; 0: not measured.
    compute: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    problems: Annotated[tuple[_Problem, ...], msgspec.Meta(max_length=MAX_PROBLEMS)] = ()
    links: Annotated[tuple[Link, ...], msgspec.Meta(max_length=MAX_LINKS)] = ()
    collective: CollectiveLinks | None = None
    # False: more is coming (its links); the round waits for the rest within its bound.
    final: bool = True


class LinkPlan(msgspec.Struct, frozen=True, kw_only=True):
    """The members of a round's collective link check, in rank order."""

    run_id: _Id
    round: Annotated[int, msgspec.Meta(ge=0)]
    members: Annotated[tuple[_Id, ...], msgspec.Meta(max_length=MAX_LINKS)]


class LinkStore(msgspec.Struct, frozen=True, kw_only=True):
    """Where the check's process groups meet: its first member's store."""

    run_id: _Id
    round: Annotated[int, msgspec.Meta(ge=0)]
    address: _Id


class By(enum.StrEnum):
    """What kept a node out (the ``by`` of its ``node_excluded`` event)."""

    HEALTH_CHECK = "health_check"  # its own checks, or its pace against its peers'
    QUARANTINE = "quarantine"  # implicated in too many of the job's failed rounds
    NO_REPORT = "no_report"  # joined, but no health report came within the bound


class Exclusion(msgspec.Struct, frozen=True):
    """A node kept out of a round, and why."""

    node: _Id
    host: _Id
    reasons: Annotated[tuple[_Problem, ...], msgspec.Meta(max_length=MAX_PROBLEMS)]
    by: By = By.HEALTH_CHECK


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """What the node that closed *round* decided: who is out, and slow links it saw."""

    run_id: _Id
    round: Annotated[int, msgspec.Meta(ge=0)]
    excluded: Annotated[tuple[Exclusion, ...], msgspec.Meta(max_length=MAX_LINKS)] = ()
    slow_links: Annotated[tuple[_Problem, ...], msgspec.Meta(max_length=MAX_LINKS)] = ()


class _Signed(msgspec.Struct, frozen=True):
    body: str
    mac: str


def health_key(secret: bytes, run_id: str) -> bytes:
    """The key of a job's health records: its secret and run id (two jobs sharing a
    secret cannot replay into each other)."""
    return hmac.new(secret, b"stalwart-health/1\0" + run_id.encode(), hashlib.sha256).digest()


def _mac(key: bytes, label: str, body: str) -> str:
    return hmac.new(key, f"{label}\0{body}".encode(), hashlib.sha256).hexdigest()


_LABELS: dict[type, str] = {}


def sign(key: bytes, rec: NodeReport | Verdict | LinkPlan | LinkStore) -> str:
    body = msgspec.json.encode(rec).decode()
    return msgspec.json.encode(_Signed(body, _mac(key, _LABELS[type(rec)], body))).decode()


class BadRecord(ValueError):
    """A store value that is not a record of this job (forged, replayed, garbled)."""


def _open(key: bytes, label: str, raw: bytes) -> str:
    if len(raw) > RECORD_LIMIT:
        raise BadRecord(f"a record of {len(raw)} bytes (the limit is {RECORD_LIMIT})")
    try:
        signed = msgspec.json.decode(raw, type=_Signed)
    except msgspec.DecodeError as err:
        raise BadRecord(f"not a signed record: {err}") from None
    if not hmac.compare_digest(signed.mac.encode(), _mac(key, label, signed.body).encode()):
        raise BadRecord("its MAC does not match (not written by a node of this job)")
    return signed.body


def open_report(key: bytes, raw: bytes, run_id: str, round_: int, node: str) -> NodeReport:
    """The report stored at ``report_key(round_, node)``; `BadRecord` when it is not one
    of this job's, for that round and node."""
    try:
        rec = msgspec.json.decode(_open(key, "report", raw), type=NodeReport)
    except msgspec.DecodeError as err:
        raise BadRecord(f"a signed body that is not a report: {err}") from None
    if (rec.run_id, rec.round, rec.node) != (run_id, round_, node):
        raise BadRecord(
            f"a report of {rec.run_id}/r{rec.round}/{rec.node} stored as {run_id}/r{round_}/{node}"
        )
    return rec


_Rec = TypeVar("_Rec", LinkPlan, LinkStore)


def _open_as(key: bytes, raw: bytes, kind: type[_Rec], run_id: str, round_: int) -> _Rec:
    try:
        rec = msgspec.json.decode(_open(key, _LABELS[kind], raw), type=kind)
    except msgspec.DecodeError as err:
        raise BadRecord(f"a signed body that is not a {_LABELS[kind]}: {err}") from None
    if (rec.run_id, rec.round) != (run_id, round_):
        raise BadRecord(f"a {_LABELS[kind]} of {rec.run_id}/r{rec.round} for {run_id}/r{round_}")
    return rec


def open_link_plan(key: bytes, raw: bytes, run_id: str, round_: int) -> LinkPlan:
    return _open_as(key, raw, LinkPlan, run_id, round_)


def open_link_store(key: bytes, raw: bytes, run_id: str, round_: int) -> LinkStore:
    return _open_as(key, raw, LinkStore, run_id, round_)


def open_verdict(key: bytes, raw: bytes, run_id: str, round_: int) -> Verdict:
    try:
        rec = msgspec.json.decode(_open(key, "verdict", raw), type=Verdict)
    except msgspec.DecodeError as err:
        raise BadRecord(f"a signed body that is not a verdict: {err}") from None
    if (rec.run_id, rec.round) != (run_id, round_):
        raise BadRecord(f"a verdict of {rec.run_id}/r{rec.round} stored as {run_id}/r{round_}")
    return rec


_LABELS.update(
    {NodeReport: "report", Verdict: "verdict", LinkPlan: "link-plan", LinkStore: "link-store"}
)
