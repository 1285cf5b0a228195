"""A stand-in rank for monitor tests: `python worker.py MODE [ARGS]`.

It uses the client exactly as a training script would, then misbehaves in the way MODE
names. It prints "READY" once its monitoring is set up so tests can wait for it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

from stalwart.monitor import RankMonitorClient, stacks, timer


def main() -> None:
    mode = sys.argv[1]
    stacks.install()
    if mode in ("gloo_block", "learn", "peer_sleeps", "peer_sleeps_no_iteration"):
        # torch and the process group come up before monitoring starts, as in a real
        # script: slow imports on a loaded machine must not count as a hang.
        gloo(mode, int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
        return
    client = RankMonitorClient()
    client.init_workload_monitoring()

    def ready() -> None:
        print("READY", flush=True)

    if mode == "rhythm":
        # steps, step seconds, every how many steps one is `slow`x slower, hang at (-1: never)
        steps, step_s = int(sys.argv[2]), float(sys.argv[3])
        slow_every, slow, hang_at = int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
        ready()
        for i in range(steps):
            if i == hang_at:
                time.sleep(600)
            slow_step = slow_every > 0 and i % slow_every == slow_every - 1
            time.sleep(step_s * (slow if slow_step else 1.0))
            client.send_heartbeat()
            client.report_iteration(i)
        client.shutdown_workload_monitoring()
        print("DONE", flush=True)
        return
    if mode == "healthy":
        steps, step_s = int(sys.argv[2]), float(sys.argv[3])
        ready()
        for i in range(steps):
            with client.section("step"):
                time.sleep(step_s)
            client.send_heartbeat()
            client.report_iteration(i)
        client.shutdown_workload_monitoring()
        print("DONE", flush=True)
        return
    # Everything below warms up with a few steps, then hangs.
    for i in range(3):
        client.send_heartbeat()
        client.report_iteration(i)
    if mode == "stop_heartbeat":
        ready()
        time.sleep(600)
    elif mode == "stop_heartbeat_own_usr1":
        # A program's own SIGUSR1 handler (Lightning's SLURM requeue is one): a hang must
        # never set it off.
        signal.signal(signal.SIGUSR1, lambda *_: print("OWN SIGUSR1 HANDLER", file=sys.stderr))
        ready()
        time.sleep(600)
    elif mode == "no_heartbeat":
        client2 = RankMonitorClient()
        client.shutdown_workload_monitoring()
        client2.init_workload_monitoring()
        ready()
        time.sleep(600)
    elif mode == "sigstop":
        ready()
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(600)
    elif mode == "gil_spin":
        ready()
        # PyDLL keeps the GIL during the call: no Python thread of this process can run.
        libc = ctypes.PyDLL(None)
        while True:
            libc.sleep(600)
    elif mode == "section_hang":
        client.start_section("outer")
        client.start_section("data")
        client.end_section("data")
        client.start_section("slow")
        ready()
        while True:
            client.send_heartbeat()
            time.sleep(0.05)
    elif mode == "reinit_section":
        # Same process, fresh client, different first section name: the monitor must not
        # keep judging with the old client's name table.
        client.start_section("relaxed")
        client.shutdown_workload_monitoring()
        again = RankMonitorClient()
        again.init_workload_monitoring()
        again.start_section("strict")
        ready()
        while True:
            again.send_heartbeat()
            time.sleep(0.05)
    elif mode == "oos_hang":
        with client.section("step"):
            pass
        ready()
        while True:
            client.send_heartbeat()
            time.sleep(0.05)
    elif mode == "timer_hang":
        ready()
        with timer.expires(after=float(sys.argv[2]), scope="train_step"):
            time.sleep(600)
    elif mode == "timer_ok":
        n = int(sys.argv[2])
        for _ in range(n):
            with timer.expires(after=30, scope="step"):
                pass
        ready()
        print("DONE", flush=True)
    elif mode == "control":
        client.send_workload_control_request(sys.argv[2])
        ready()
        print("DONE", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode}")


def gloo(mode: str, rank: int, port: int, rest: list[str]) -> None:
    import json

    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"
    )
    dist.init_process_group("gloo", rank=rank, world_size=2)
    client = RankMonitorClient()
    client.init_workload_monitoring()
    if mode == "gloo_block":
        print("READY", flush=True)
        if rank == 0:
            client.send_heartbeat()
            dist.all_reduce(torch.ones(1))  # the peer never joins
        while True:
            client.send_heartbeat()
            time.sleep(0.05)
    if mode == "peer_sleeps_no_iteration":
        # As examples/train_ddp.py with sections: heartbeats without iterations, right
        # after each step's collective, so both ranks' last beats are a moment apart.
        # Rank 1 falls asleep at step `at` after its beat; rank 0 opens the next step's
        # section and blocks in its collective.
        at = int(rest[0])
        print("READY", flush=True)
        for step in range(10_000):
            if rank == 1 and step == at:
                time.sleep(600)
            with client.section("step"):
                dist.all_reduce(torch.ones(1))
            client.send_heartbeat()
        return
    if mode == "peer_sleeps":
        # Rank 1 falls asleep at step `at` between its collective and its heartbeat, as a
        # Lightning callback would; rank 0 reports that step and blocks in the next one.
        at = int(rest[0])
        print("READY", flush=True)
        for step in range(10_000):
            dist.all_reduce(torch.ones(1))
            if rank == 1 and step == at:
                time.sleep(600)
            client.send_heartbeat()
            client.report_iteration(step)
            time.sleep(0.02)
        return
    # learn: rank 1 is the slower one, so the agreed timeouts must come from it.
    gap = 0.02 * (rank + 1)
    for _ in range(4):
        time.sleep(gap)
        client.send_heartbeat()
        with client.section("step"):
            time.sleep(2 * gap)
    client.calculate_and_set_hb_timeouts()
    client.calculate_and_set_section_timeouts()
    with open(rest[0], "w") as f:
        json.dump(client.state_dict(), f)
    # The learned timeouts are a fraction of a second: stop being judged before teardown.
    client.shutdown_workload_monitoring()
    dist.barrier()
    print("READY", flush=True)
    print("DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
