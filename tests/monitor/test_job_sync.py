"""What node monitors share through the job's store: two `stalwart run` agents on this
machine form one job (``--nnodes 2`` on 127.0.0.1), as two nodes would.

* learned timeouts: only one node's rank has slow steps, both nodes end with its values;
* stragglers: a rank sleeping 3x its step on one node is named against the job's ranks,
  a healthy job names none, and with ``--straggler-restart`` (elastic) the job restarts
  without the straggler's node.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stalwart.monitor import jobsync
from stalwart.monitor.learned import LearnedTimeouts
from tests.helpers import wait_for, wait_listening

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("node_worker.py")

pytestmark = pytest.mark.timeout(180)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(tmp: Path, node: int, args: list[str], plan: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable, "-m", "stalwart.cli", "run", "--nproc-per-node", "1",
            "--node-rank", str(node), "--log-dir", str(tmp / f"n{node}"), "--redirects", "3",
            *args, str(WORKER), str(tmp), json.dumps(plan),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


def static_args(port: int, run_id: str) -> list[str]:
    return ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
            "--rdzv-id", run_id]  # fmt: skip


def run_two(
    tmp: Path, args: list[str], plan: dict[str, Any], port: int, while_running: Any = None
) -> dict[int, str]:
    first = launch(tmp, 0, args, plan)
    procs = {0: first}
    try:
        wait_listening(port, first, "node 0 to host the store")
        procs[1] = launch(tmp, 1, args, plan)
        if while_running is not None:
            while_running()
        outs = {n: p.communicate(timeout=150)[0] for n, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    return outs


def events(tmp: Path, node: int) -> list[dict[str, Any]]:
    (run,) = [d for d in (tmp / f"n{node}").iterdir() if d.is_dir()]
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]


def learned_file(tmp: Path, node: int) -> dict[str, Any] | None:
    runs = (
        [d for d in (tmp / f"n{node}").iterdir() if d.is_dir()]
        if (tmp / f"n{node}").exists()
        else []
    )
    path = runs[0] / "learned_timeouts.json" if runs else None
    if path is None or not path.exists():
        return None
    return dict(json.loads(path.read_text()))


@pytest.mark.slow
def test_learned_timeouts_agree_across_nodes(tmp_path: Path) -> None:
    """Node 1's rank has three 0.4 s steps in its warm-up (learned from); node 0's steps
    are all 20 ms. Both nodes end with node 1's learned heartbeat timeout, in their
    events and their learned_timeouts.json."""
    port = free_port()
    until = tmp_path / "enough"
    plan = {"steps": 60, "step": 0.02, "slow_node": 1, "slow_steps": [18, 22, 26], "slow": 0.4,
            "until": str(until)}  # fmt: skip
    args = [*static_args(port, "learnsync"), "--hb-timeout", "auto",
            "--auto-warmup-steps", "30", "--max-restarts", "0"]  # fmt: skip

    def agreed() -> None:
        def same() -> bool:
            a, b = learned_file(tmp_path, 0), learned_file(tmp_path, 1)
            return a is not None and a == b and a["heartbeat"]["subsequent"] >= 5 * 0.4

        wait_for(same, 90, "both nodes to hold node 1's learned timeout")
        until.touch()

    outs = run_two(tmp_path, args, plan, port, agreed)
    for n in (0, 1):
        assert "Traceback" not in outs[n], outs[n][-3000:]
    assert (tmp_path / "done_0_0").exists() and (tmp_path / "done_0_1").exists(), outs
    final = {n: learned_file(tmp_path, n) for n in (0, 1)}
    assert final[0] == final[1], final
    assert final[0] is not None and final[0]["heartbeat"]["subsequent"] >= 2.0
    ev0 = [e for e in events(tmp_path, 0) if e["event"] == "timeouts_learned"]
    ev1 = [e for e in events(tmp_path, 1) if e["event"] == "timeouts_learned"]
    # Node 0 took the value from the job; node 1 learned it from its own rank.
    assert any(e["source"] == "job" for e in ev0), ev0
    assert ev0[-1]["heartbeat"] == ev1[-1]["heartbeat"] == final[0]["heartbeat"], (ev0, ev1)
    assert not any(e["event"] == "hang_detected" for n in (0, 1) for e in events(tmp_path, n))


def straggler_events(tmp: Path, node: int) -> list[dict[str, Any]]:
    return [e for e in events(tmp, node) if e["event"] == "straggler"]


@pytest.mark.slow
def test_straggler_on_another_node_is_named(tmp_path: Path) -> None:
    """One rank per node: neither node can tell a straggler from its own ranks alone.
    Node 1's rank sleeps 3x the step of node 0's; node 1 names it against the job."""
    port = free_port()
    plan = {"seconds": 6, "step": 0.03, "slow_node": 1, "slow_factor": 3.0}
    args = [*static_args(port, "strag"), "--hb-timeout", "30", "--straggler-window", "1",
            "--max-restarts", "0"]  # fmt: skip
    outs = run_two(tmp_path, args, plan, port)
    for n in (0, 1):
        assert "Traceback" not in outs[n], outs[n][-3000:]
    named = straggler_events(tmp_path, 1)
    assert named, outs[1][-3000:]
    assert {e["global_rank"] for e in named} == {1}
    assert all(1.8 <= e["ratio"] <= 5.0 for e in named), named
    assert named[0]["host"] == socket.gethostname() and named[0]["nodes_compared"] == 2
    assert straggler_events(tmp_path, 0) == []  # each node names its own ranks only
    assert "is a straggler" in outs[1] and outs[1].count("is a straggler") == 1  # rate-limited
    assert (tmp_path / "done_0_1").exists()  # information only: nothing was restarted


@pytest.mark.slow
def test_healthy_job_names_no_straggler(tmp_path: Path) -> None:
    port = free_port()
    plan = {"seconds": 6, "step": 0.03}
    args = [*static_args(port, "nostrag"), "--hb-timeout", "30", "--straggler-window", "2",
            "--max-restarts", "0"]  # fmt: skip
    outs = run_two(tmp_path, args, plan, port)
    for n in (0, 1):
        assert "Traceback" not in outs[n], outs[n][-3000:]
        assert (tmp_path / f"done_0_{n}").exists(), outs[n][-3000:]
        assert straggler_events(tmp_path, n) == []


@pytest.mark.slow
def test_straggler_restart_goes_on_without_its_node(tmp_path: Path) -> None:
    port = free_port()
    plan = {"steps": 2000, "step": 0.03, "slow_node": 1, "slow_factor": 3.0, "then_steps": 5}
    args = [
        "--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "stragrestart", "--rdzv-conf", "last_call_timeout=30,keep_alive_interval=0.5",
        "--max-restarts", "1", "--hb-timeout", "30", "--straggler-window", "1",
        "--straggler-restart",
    ]  # fmt: skip
    outs = run_two(tmp_path, args, plan, port)
    for n in (0, 1):
        assert outs[n] and "Traceback" not in outs[n], outs[n][-3000:]
    assert "is a straggler" in outs[1] and "the job goes on with the other nodes" in outs[1]
    out1 = [e for e in events(tmp_path, 1) if e["event"] == "node_excluded"]
    assert out1 and "straggler" in out1[0]["reason"], out1
    # Node 0 ran attempt 1 alone and finished; node 1 never started attempt 1.
    assert (tmp_path / "done_1_0").read_text() == "5"
    assert not (tmp_path / "done_1_1").exists() and not (tmp_path / "done_0_1").exists()
    ev0 = events(tmp_path, 0)
    assert any(e["event"] == "node_excluded" for e in ev0), [e["event"] for e in ev0]
    assert any(e["event"] == "job_succeeded" for e in ev0)


def test_straggler_restart_needs_elastic_membership() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "stalwart.cli", "run", "--nnodes", "2", "--straggler-restart",
         str(WORKER)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--straggler-restart with --nnodes 2" in lines[0], proc.stderr


@pytest.mark.parametrize(
    ("raw", "ok"),
    [
        (b'{"version":1,"heartbeat":{"initial":null,"subsequent":2.5}}', True),
        (b'{"version":1,"sections":{"ckpt":4.0},"out_of_section":3}', True),
        (b'{"version":2,"heartbeat":{"subsequent":2.5}}', False),
        (b'{"version":1,"heartbeat":{"subsequent":-1}}', False),
        (b'{"version":1,"heartbeat":{"subsequent":1e300}}', False),
        (b"[1,2]", False),
        (b"\xff\xfe", False),
        (b"{" * 50_000, False),
        (b'{"version":1,"pad":"' + b"x" * 70_000 + b'"}', False),
    ],
)
def test_decode_learned_table(raw: bytes, ok: bool) -> None:
    if ok:
        assert isinstance(jobsync.decode_learned(raw), LearnedTimeouts)
    else:
        with pytest.raises(ValueError) as info:
            jobsync.decode_learned(raw)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("raw", "ok"),
    [
        (b'{"host":"a","window":30,"step_times":{"0":0.1,"3":0.2}}', True),
        (b'{"host":"a","window":30,"step_times":{}}', True),
        (b'{"host":"a","window":30,"step_times":{"-1":0.1}}', False),
        (b'{"host":"a","window":30,"step_times":{"0":0}}', False),
        (b'{"host":"a","window":30,"step_times":{"0":1e999}}', False),
        (b'{"host":"a","window":0,"step_times":{}}', False),
        (b'{"host":"a","window":30,"step_times":{},"extra":1}', False),
        (b"not json", False),
    ],
)
def test_decode_rhythm_table(raw: bytes, ok: bool) -> None:
    if ok:
        assert isinstance(jobsync.decode_rhythm(raw), jobsync.NodeRhythm)
    else:
        with pytest.raises(ValueError):
            jobsync.decode_rhythm(raw)


def test_pool_rhythms_keeps_own_ranks_and_lower_nodes() -> None:
    mine = jobsync.NodeRhythm("me", 1.0, {2: 0.3, 3: 0.1})
    others = [
        (2, jobsync.NodeRhythm("c", 1.0, {4: 0.1, 0: 9.0})),
        (0, jobsync.NodeRhythm("a", 1.0, {0: 0.1, 2: 5.0})),  # rank 2 is ours: ours wins
        (1, jobsync.NodeRhythm("me", 1.0, {9: 1.0})),  # our own key read back: skipped
    ]
    steps, hosts = jobsync.pool_rhythms(mine, 1, others)
    assert steps == {2: 0.3, 3: 0.1, 0: 0.1, 4: 0.1}
    assert hosts == {2: "me", 3: "me", 0: "a", 4: "c"}


def test_store_sync_is_cheap_when_nothing_changes() -> None:
    """Between changes a node reads one counter per poll, however many nodes."""
    from stalwart.monitor import MonitorConfig
    from stalwart.monitor.node_learned import Learning
    from stalwart.monitor.node_stragglers import StragglerWatch
    from stalwart.monitor.node_sync import JobSync

    class Store:
        def __init__(self) -> None:
            self.data: dict[str, bytes] = {}
            self.calls: list[str] = []

        def get_many(self, keys: list[str]) -> list[bytes | None]:
            self.calls.append("get_many")
            return [self.data.get(k) for k in keys]

        def set(self, key: str, value: str) -> None:
            self.calls.append("set")
            self.data[key] = value.encode()

        def add(self, key: str, amount: int) -> int:
            self.calls.append("add")
            value = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(value).encode()
            return value

    store = Store()
    other = LearnedTimeouts(hb=3.0)
    store.set(jobsync.learned_key(0, 1), jobsync.encode_learned(other))
    store.add(jobsync.learned_version_key(0), 1)
    store.calls.clear()
    seen: list[tuple[str, dict[str, Any]]] = []
    config = MonitorConfig(hb_auto=True)
    learning = Learning(config, None, lambda e, f: seen.append((e, f)))
    watch = StragglerWatch(config, lambda e, f: None, lambda r: None, lambda lr: 0)
    sync = JobSync(config, learning, watch)
    peers = jobsync.JobPeers(store, round=0, node_rank=0, nnodes=64)
    sync.sync_once(peers)  # first poll: reads every node's value, applies the maximum
    assert learning.current.hb == 3.0 and seen[-1][1]["source"] == "job"
    assert store.calls == ["add", "get_many"]
    store.calls.clear()
    for _ in range(5):
        sync.sync_once(peers)
    assert store.calls == ["add"] * 5  # nothing changed: the counter only


@pytest.mark.parametrize(
    ("reads", "expected"),
    [
        # (node, seq, now): a window is fresh when its seq moved, or moved lately
        ([(1, 1, 0.0), (1, 1, 1.5), (1, 1, 2.0)], [True, True, True]),
        ([(1, 1, 0.0), (1, 1, 2.5)], [True, False]),
        ([(1, 1, 0.0), (1, 1, 2.5), (1, 2, 2.6)], [True, False, True]),
        ([(1, 1, 0.0), (2, 1, 2.5), (1, 1, 2.6)], [True, True, False]),
    ],
)
def test_freshness_table(reads: list[tuple[int, int, float]], expected: list[bool]) -> None:
    f = jobsync.Freshness(stale_after=2.0)
    assert [f.fresh(n, seq, now) for n, seq, now in reads] == expected
