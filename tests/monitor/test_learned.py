"""Learned timeouts: agreed across ranks, applied to the monitor at once, persisted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stalwart.monitor import MonitorConfig, RankMonitorClient, envvars, layout
from stalwart.monitor.learned import Observations, gather_json, merge_max
from tests.helpers import free_port

from .conftest import Harness


@pytest.mark.timeout(90)
def test_learned_timeouts_agree_across_two_gloo_ranks(harness: Harness, tmp_path: Path) -> None:
    mon = harness.start(MonitorConfig(safety_factor=5.0), nranks=2)
    port = str(free_port())
    outs = [tmp_path / f"state{r}.json" for r in range(2)]
    procs = [harness.spawn(r, "learn", str(r), port, str(outs[r])) for r in range(2)]
    mon.begin_attempt(0, {r: p.pid for r, p in enumerate(procs)})
    for p in procs:
        assert p.wait(timeout=60) == 0
    states = [json.loads(o.read_text()) for o in outs]
    assert states[0] == states[1]
    learned = states[0]["stalwart_monitor"]
    # Rank 1 sleeps 0.04 s between heartbeats and 0.08 s per step; rank 0 half that.
    assert learned["heartbeat"]["subsequent"] >= 5 * 0.04 + 5 * 0.08
    assert learned["sections"]["step"] >= 5 * 0.08
    assert learned["out_of_section"] >= 5 * 0.04
    # Both ranks wrote the agreed values into their slots: the monitor uses them.
    for r in range(2):
        snap = layout.read_slot(mon._slots.mapping, r)
        assert snap.hb_override == pytest.approx(learned["heartbeat"]["subsequent"])
        assert snap.oos_override == pytest.approx(learned["out_of_section"])
        names = layout.read_names(mon._slots.mapping, r, snap.name_count)
        assert snap.limits[names.index("step")] == pytest.approx(learned["sections"]["step"])


def _attach(monkeypatch: pytest.MonkeyPatch, shm: Path, slot: int = 0) -> None:
    monkeypatch.setenv(envvars.SHM_FILE, str(shm))
    monkeypatch.setenv(envvars.SLOT, str(slot))


@pytest.mark.timeout(30)
def test_state_dict_round_trip_reaches_the_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shm = tmp_path / "seg"
    mm = layout.create_segment(shm, 2)
    _attach(monkeypatch, shm, 1)
    monkeypatch.setenv("WORLD_SIZE", "1")
    first = RankMonitorClient(install_stack_dump=False, safety_factor=3.0)
    first.init_workload_monitoring()
    for _ in range(3):
        first.send_heartbeat()
        with first.section("fwd"):
            pass
    assert first.calculate_and_set_hb_timeouts()
    assert first.calculate_and_set_section_timeouts()
    state = json.loads(json.dumps(first.state_dict()))  # must be plain JSON
    first.shutdown_workload_monitoring()

    second = RankMonitorClient(install_stack_dump=False)
    second.load_state_dict(state)  # before init: applied at init
    second.init_workload_monitoring()
    snap = layout.read_slot(mm, 1)
    assert snap.hb_override == pytest.approx(state["stalwart_monitor"]["heartbeat"]["subsequent"])
    assert snap.hb_initial_override >= snap.hb_override
    names = layout.read_names(mm, 1, snap.name_count)
    assert snap.limits[names.index("fwd")] == pytest.approx(
        state["stalwart_monitor"]["sections"]["fwd"]
    )
    assert second.state_dict() == state
    # After init: takes effect at once.
    state["stalwart_monitor"]["heartbeat"]["subsequent"] = 42.0
    second.load_state_dict(state)
    assert layout.read_slot(mm, 1).hb_override == 42.0
    second.shutdown_workload_monitoring()


def test_not_ready_raises_or_skips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout.create_segment(tmp_path / "seg", 1)
    _attach(monkeypatch, tmp_path / "seg")
    monkeypatch.setenv("WORLD_SIZE", "1")
    client = RankMonitorClient(install_stack_dump=False)
    client.init_workload_monitoring()
    assert client.calculate_and_set_hb_timeouts(skip_if_not_ready=True) is False
    with pytest.raises(RuntimeError, match="not enough heartbeats"):
        client.calculate_and_set_hb_timeouts()
    with pytest.raises(RuntimeError, match="'nope'"):
        client.calculate_and_set_section_timeouts(selected_sections=["nope"])
    client.shutdown_workload_monitoring()


def test_store_exchange_takes_max_over_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeStore:
        def __init__(self) -> None:
            self.data: dict[str, bytes] = {}

        def set(self, key: str, value: bytes) -> None:
            self.data[key] = value

        def get(self, key: str) -> bytes:
            return self.data[key]

    store = FakeStore()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    peer = Observations(hb=2.0, sections={"b": 1.0}).to_json()
    store.set("stalwart/monitor/learn/7/1", json.dumps(peer).encode())
    mine = Observations(hb=1.0, hb_initial=9.0, sections={"a": 3.0}).to_json()
    merged = merge_max([Observations.from_json(p) for p in gather_json(mine, store, 7)])
    assert merged == Observations(hb_initial=9.0, hb=2.0, sections={"a": 3.0, "b": 1.0}, oos=None)


def test_multi_rank_without_sync_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"initialise torch\.distributed"):
        gather_json({}, None, 1)


@pytest.mark.timeout(60)
def test_launcher_hosted_store_is_used_without_a_process_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import datetime

    import torch.distributed as dist

    port = free_port()
    tcp_store: Any = dist.TCPStore  # type: ignore[attr-defined]
    host = tcp_store("127.0.0.1", port, is_master=True, timeout=datetime.timedelta(seconds=30))
    host.set("stalwart/monitor/learn/3/1", json.dumps(Observations(hb=4.0).to_json()))
    for key, value in {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "RANK": "0",
    }.items():
        monkeypatch.setenv(key, value)
    got = gather_json(Observations(hb=1.0).to_json(), None, 3)
    assert [g["hb"] for g in got] == [1.0, 4.0]
