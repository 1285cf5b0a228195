"""The resume step's exchange through the job's store: a value at a peer's key is read
as hostile (anyone who reaches the store can write it), through a real TCPStore."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from stalwart.checkpoint.errors import CheckpointError
from stalwart.checkpoint.resume import (
    MAX_CANDIDATES,
    MAX_EXCHANGE_BYTES,
    _StoreExchange,
)


@pytest.fixture(scope="module")
def store() -> Iterator[TCPStore]:
    st = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    yield st


def _forged(store: TCPStore, value: bytes) -> _StoreExchange:
    """Rank 0 of 2, with a stranger's value already at rank 1's key of the first round."""
    ex = _StoreExchange(store, rank=0, world_size=2, timeout_s=5.0)
    store.set(f"{ex._base}/0/1", value)
    return ex


def test_peers_lists_are_gathered(store: TCPStore) -> None:
    ex = _forged(store, b"[7,5,3]")
    assert ex.all_gather([7, 5]) == [[7, 5], [7, 5, 3]]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        # Huge, though well-formed: 3 MB of steps.
        (b"[" + b",".join([b"1"] * 1_500_000) + b"]", f"over the limit of {MAX_EXCHANGE_BYTES}"),
        # Deeply nested within the byte limit: json.loads recursed into it.
        (b"[" * 1000 + b"]" * 1000, "expected a JSON list"),
        (b"[" * 200_000 + b"]" * 200_000, f"over the limit of {MAX_EXCHANGE_BYTES}"),
        # More candidates than a rank ever offers.
        (b"[" + b",".join([b"9"] * (MAX_CANDIDATES + 1)) + b"]", "at most 64 steps"),
        (b'{"steps": [1]}', "expected a JSON list"),
        (b"[1, 2.5]", "expected a JSON list"),
        (b"[-4]", "expected a JSON list"),
        (b"[99999999999999999999999]", "expected a JSON list"),
        (b"\xff\xfe", "expected a JSON list"),
    ],
)
def test_a_forged_peer_value_is_refused_in_one_line(
    store: TCPStore, value: bytes, message: str
) -> None:
    ex = _forged(store, value)
    start = time.monotonic()
    with pytest.raises(CheckpointError) as err:
        ex.all_gather([3])
    text = str(err.value)
    assert "\n" not in text and len(text) < 400, text
    assert f"store key {ex._base}/0/1" in text and message in text
    assert time.monotonic() - start < 5.0
