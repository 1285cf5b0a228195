"""The seal on the job's store records, as a table: what a stranger who can write any
key (but holds no job secret) gets the reader to accept. No processes: the store is a
``MemoryKV`` the stranger shares with the node."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from stalwart.base.sealed import VALUE_LIMIT, Seal, SealError, derive_key
from stalwart.launch.replicas.auth import job_key
from stalwart.launch.round.membership import store_seal
from stalwart.rendezvous import keys
from stalwart.rendezvous.kv import MemoryKV, MemoryStore, SealedKV

pytestmark = pytest.mark.timeout(30)

SECRET = b"s" * 32


def node_and_stranger(secret: bytes | None = SECRET) -> tuple[SealedKV, MemoryKV]:
    data = MemoryStore()
    return SealedKV(MemoryKV(data), store_seal(secret, "job")), MemoryKV(data)


STEERING = [
    keys.JOB_ENDED,
    keys.Round(0).failure(1),
    keys.Round(0).failed,
    keys.Round(0).master,
    keys.Round(0).nproc(1),
    keys.Round(2).closed,
    keys.Round(2).node(0),
    keys.heartbeat("n1"),
    keys.left("n1"),
]


@pytest.mark.parametrize("key", STEERING)
def test_a_strangers_value_reads_as_absent(key: str) -> None:
    node, stranger = node_and_stranger()
    stranger.set(key, '{"succeeded": true}')
    assert node.get(key) is None
    assert node.get_many([key, key]) == [None, None]
    assert node.refused == 3


@pytest.mark.parametrize("key", STEERING)
def test_the_jobs_own_value_reads_back(key: str) -> None:
    node, _ = node_and_stranger()
    node.set(key, "127.0.0.1:29500")
    assert node.get(key) == b"127.0.0.1:29500"


def test_a_genuine_value_moved_to_another_key_is_refused() -> None:
    node, stranger = node_and_stranger()
    node.set(keys.Round(0).failure(0), "record of node 0")
    raw = stranger.get(keys.Round(0).failure(0))
    assert raw is not None
    for other in (keys.Round(0).failure(1), keys.Round(5).failure(0), keys.JOB_ENDED):
        stranger.set(other, raw.decode())
        assert node.get(other) is None, other


@pytest.mark.parametrize(
    "tamper",
    [
        lambda raw: raw[:-1] + b"X",  # the value changed
        lambda raw: raw.replace(b"hmac1:", b"hmac1: "),
        lambda raw: raw[:6] + b"0" * 64 + raw[70:],  # a MAC of zeros
        lambda raw: raw[70:],  # the MAC cut off
        lambda raw: raw + b"7" * (VALUE_LIMIT + 1),  # oversized
    ],
)
def test_a_tampered_value_is_refused(tamper: object) -> None:
    node, stranger = node_and_stranger()
    node.set(keys.JOB_ENDED, '{"succeeded": false}')
    raw = stranger.get(keys.JOB_ENDED)
    assert raw is not None
    stranger.set(keys.JOB_ENDED, tamper(raw).decode(errors="replace"))  # type: ignore[operator]
    assert node.get(keys.JOB_ENDED) is None


def test_another_jobs_secret_does_not_open_it() -> None:
    data = MemoryStore()
    ours = SealedKV(MemoryKV(data), store_seal(SECRET, "job"))
    theirs = SealedKV(MemoryKV(data), store_seal(b"t" * 32, "job"))
    same_secret_other_job = SealedKV(MemoryKV(data), store_seal(SECRET, "other"))
    theirs.set(keys.JOB_ENDED, "end")
    same_secret_other_job.set(keys.Round(0).master, "10.0.0.9:1")
    assert ours.get(keys.JOB_ENDED) is None
    assert ours.get(keys.Round(0).master) is None


def test_a_strangers_create_is_not_taken_for_the_jobs() -> None:
    node, stranger = node_and_stranger()
    stranger.create(keys.Round(1).closed, "[0, 7]")
    assert node.create(keys.Round(1).closed, "[0, 1]") == b""
    assert node.get(keys.Round(1).closed) is None


def test_the_run_id_stays_readable_to_a_node_of_another_job() -> None:
    node, stranger = node_and_stranger()
    node.set(keys.RUN_ID, "job")
    assert stranger.get(keys.RUN_ID) == b"job"


def test_without_a_secret_values_pass_but_stay_bounded() -> None:
    node, stranger = node_and_stranger(None)
    stranger.set(keys.JOB_ENDED, "end")
    assert node.get(keys.JOB_ENDED) == b"end"
    stranger.set(keys.JOB_ENDED, "7" * (2 << 20))
    assert node.get(keys.JOB_ENDED) is None


def test_seal_errors_are_one_line() -> None:
    seal = Seal(derive_key(SECRET, "x", "job"), "x")
    for raw in (b"plain", b"hmac1:" + b"0" * 64 + b":v", b"7" * (VALUE_LIMIT + 100)):
        with pytest.raises(SealError) as err:
            seal.open("k", raw)
        assert "\n" not in str(err.value)


def test_the_replicas_key_is_unchanged() -> None:
    # Nodes of two stalwart versions in one job must agree on the replicas' key.
    want = hmac.new(SECRET, b"stalwart-replicas/1\0job", hashlib.sha256).digest()
    assert job_key(SECRET, "job") == want
