"""An elastic FSDP2 job on two simulated hosts loses a node, reshards to the smaller world
and goes on, then grows back when the node returns.

The job is ``bench/fsdp_resize_job.py``: plain FSDP2 + DCP, no stalwart import, no
``__main__`` guard, a checkpoint folder both hosts see.  One run shrinks 4 -> 2 and
grows 2 -> 4; everything is asserted from it: the gathered state after each resize
equals the state saved for the step it loaded, bit for bit, and the first batch
trained after each resize is the one after that step.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from bench.netns import Host, Network
from tests.helpers import free_port, read_events, wait_for
from tests.reliability.fsdp_setup import same

pytestmark = pytest.mark.timeout(180)

JOB = Path(__file__).parents[2] / "bench" / "fsdp_resize_job.py"
FAST = (
    "keep_alive_interval=0.5,keep_alive_max_attempt=3,last_call_timeout=3,"
    "join_timeout=40,close_timeout=5"
)


def launch(host: Host, out: Path, endpoint: str, name: str) -> subprocess.Popen[str]:
    return host.stalwart(
        "--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "3",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "resize",
        "--rdzv-conf", FAST, "--shutdown-timeout", "3", "--log-dir", out / f"logs-{name}",
        JOB, out, out / "ckpt", "400", "0.05",
        log=out / f"{name}.out",
    )  # fmt: skip


def rows(out: Path, name: str) -> list[dict[str, object]]:
    try:
        text = (out / name).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def wait_steps(out: Path, world: int, n: int, procs: list[subprocess.Popen[str]]) -> None:
    """Until the job has trained ``n`` steps at ``world`` ranks since it last resized."""

    def reached() -> bool:
        for p in procs:
            assert p.poll() is None, f"a launcher exited early ({p.returncode})"
        steps = rows(out, "steps.jsonl")
        tail = 0
        for r in reversed(steps):
            if r["world"] != world:
                break
            tail += 1
        return tail >= n

    wait_for(reached, 90, f"{n} steps at world {world}", interval=0.05)


def test_fsdp2_job_shrinks_to_one_node_and_grows_back(network: Network, tmp_path: Path) -> None:
    a, b = network.add_host(), network.add_host()
    endpoint = f"{a.addr}:{free_port()}"
    out = tmp_path
    pa = launch(a, out, endpoint, "a")
    pb = launch(b, out, endpoint, "b")
    wait_steps(out, 4, 3, [pa, pb])
    pb.send_signal(signal.SIGKILL)  # node b's launcher; its workers follow it
    pb.wait()
    wait_steps(out, 2, 3, [pa])
    pb2 = launch(b, out, endpoint, "b2")  # the node is back: a new launcher joins
    wait_steps(out, 4, 3, [pa, pb2])
    (out / "stop").write_text("")
    assert pa.wait(60) == 0, (out / "a.out").read_text()[-3000:]
    assert pb2.wait(60) == 0, (out / "b2.out").read_text()[-3000:]

    resumes = rows(out, "resumes.jsonl")
    assert [r["world"] for r in resumes] == [4, 2, 4], resumes
    assert resumes[0]["loaded"] is None
    steps = rows(out, "steps.jsonl")
    for r in resumes[1:]:
        world, loaded = int(r["world"]), int(r["loaded"])  # type: ignore[call-overload]
        # The newest complete step: the last one whose save finished before the resize
        # (a save torn by the loss has no .metadata and is skipped).
        before = [s for s in steps if s["t"] < r["t"]]
        done = [int(s["step"]) for s in before]  # type: ignore[call-overload]
        assert loaded in (done[-1], done[-1] + 1), (loaded, done[-3:])
        # Bit for bit: the state gathered at the new size is the one saved for the step.
        saved = torch.load(out / f"full_{loaded}.pt", weights_only=True)
        restored = torch.load(out / f"restored_{world}_{loaded}.pt", weights_only=True)
        same(saved, restored)
        # The data position came back with it: the next batch follows the loaded step.
        assert r["next_index"] == saved["data"]["next_index"] == loaded
        after = [s for s in steps if s["t"] > r["t"]]
        assert after[0] == {**after[0], "world": world, "step": loaded + 1, "index": loaded}
    # The grow was a restart of the running node's workers, said in its events.
    ev = [e for f in (out / "logs-a").glob("*/events.jsonl") for e in read_events(f)]
    assert any(e["event"] == "nodes_waiting" for e in ev), sorted({e["event"] for e in ev})
