"""Code written for NVIDIA's RankMonitorClient, with only its import line changed
(issue 12 item 4, client part): a state dict saved in NVIDIA's format restores the
learned timeouts, the timeouts in force read back in NVIDIA's shape, and NVIDIA's
error name is catchable."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from stalwart.monitor import RankMonitorClient, RankMonitorClientError, RankMonitorError, envvars
from tests.helpers import ROOT, clean_env, read_events, stalwart_argv

# What NVIDIA's RankMonitorClient.state_dict() returns after calculate_and_set_*_timeouts.
NVIDIA_STATE: dict[str, Any] = {
    "current_timeouts": {
        "heartbeat": {"initial": 60.0, "subsequent": 30.0, "were_calculated": True},
        "section": {
            "section": {"step": 40.0, "eval": None},
            "out_of_section": 50.0,
            "calculated_sections": ["step"],
            "is_out_of_section_calculated": True,
        },
    }
}

# The rank program: NVIDIA's calls in NVIDIA's order (load before init is allowed there).
SCRIPT = """
import json, sys, time
from stalwart.monitor import RankMonitorClient, RankMonitorClientError

client = RankMonitorClient()
client.load_state_dict(json.loads(sys.argv[1]))
client.init_workload_monitoring()
client.send_heartbeat()
client.start_section("step")
time.sleep(2.5)          # longer than the configured 1 s, well within the learned 40 s
client.end_section("step")
time.sleep(2.5)          # out of section: configured 1 s, learned 50 s
client.send_heartbeat()  # 5 s since the last one: configured 1 s, learned 30 s
hb, sec = client.hb_timeouts, client.section_timeouts
print("TIMEOUTS " + json.dumps({
    "hb": [hb.initial, hb.subsequent, hb.were_calculated, hb.are_valid],
    "section": sec.section, "oos": sec.out_of_section,
    "calculated": sorted(sec.calculated_sections), "oos_calculated": sec.is_out_of_section_calculated,
}), flush=True)
client.shutdown_workload_monitoring()
"""


@pytest.mark.timeout(120)
def test_nvidia_state_dict_keeps_a_slow_rank_alive_under_stalwart_run(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    logs = tmp_path / "logs"
    proc = subprocess.run(
        stalwart_argv("--nproc-per-node", "1",
         "--max-restarts", "0", "--rdzv-id", "nvidia-state", "--log-dir", str(logs),
         "--hb-timeout", "1", "--section-timeout", "step=1", "--section-timeout", "eval=7",
         "--out-of-section-timeout", "1", "--redirects", "1",
         script, json.dumps(NVIDIA_STATE)),
        capture_output=True, text=True, timeout=100, env=clean_env(), cwd=ROOT,
    )  # fmt: skip
    events = read_events(logs / "nvidia-state" / "events.jsonl")
    names = [e["event"] for e in events]
    assert proc.returncode == 0, (names, proc.stderr[-3000:])
    assert "hang_detected" not in names
    out = "".join(p.read_text() for p in logs.rglob("stdout.log"))
    line = next(x for x in out.splitlines() if x.startswith("TIMEOUTS "))
    got = json.loads(line.removeprefix("TIMEOUTS "))
    assert got["hb"] == [60.0, 30.0, True, True]
    # In force: learned "step", configured "eval" (NVIDIA's saved config value is not used).
    assert got["section"] == {"step": 40.0, "eval": 7.0}
    assert got["oos"] == 50.0 and got["calculated"] == ["step"] and got["oos_calculated"]


def test_timeouts_in_force_come_from_the_config_until_learned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(
        envvars.TIMEOUTS, json.dumps({"hb_initial": 60, "hb": 5, "sections": {"a": 2}, "oos": 9})
    )
    client = RankMonitorClient()
    assert client.hb_timeouts is None and client.section_timeouts is None  # as NVIDIA's
    client.init_workload_monitoring()
    hb = client.hb_timeouts
    assert hb is not None and (hb.initial, hb.subsequent, hb.were_calculated) == (60.0, 5.0, False)
    assert client.section_timeouts.section == {"a": 2.0}
    assert client.section_timeouts.out_of_section == 9.0
    client.load_state_dict(NVIDIA_STATE)
    assert client.hb_timeouts.subsequent == 30.0 and client.hb_timeouts.were_calculated
    assert client.section_timeouts.section == {"a": 2.0, "step": 40.0}
    # Round trip through stalwart's own format keeps what was learned.
    again = RankMonitorClient()
    again.load_state_dict(client.state_dict())
    assert again.learned == client.learned


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"timeouts": {}}, "key(s) 'timeouts'; expected 'stalwart_monitor' (stalwart) or 'current_timeouts'"),
        ({"current_timeouts": {"hb": {}}}, "unknown key(s) hb; expected heartbeat, section"),
        ({"current_timeouts": {"heartbeat": {"initial": 1, "subsequent": -2}}}, "heartbeat subsequent must be > 0"),
        ({"current_timeouts": {"section": {"section": [], "calculated_sections": ["x"]}}}, "'section' must be a mapping"),
        ([("current_timeouts", {})], "expects a mapping"),
    ],
)  # fmt: skip
def test_anything_else_is_a_clear_error(state: Any, message: str) -> None:
    with pytest.raises(
        RankMonitorClientError, match=message.replace("(", r"\(").replace(")", r"\)")
    ):
        RankMonitorClient().load_state_dict(state)


def test_empty_state_and_nvidia_error_name() -> None:
    client = RankMonitorClient()
    client.load_state_dict({})  # no checkpoint yet: nothing to restore
    assert client.learned.hb is None
    assert RankMonitorClientError is RankMonitorError
    with pytest.raises(RankMonitorClientError):
        client.send_heartbeat()
