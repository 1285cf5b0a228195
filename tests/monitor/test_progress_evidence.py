"""The pure rules of progress without code (issue 22): evidence of a hang, a rank's part
in it read from its stack, blame on that evidence, the default configuration, and the
optimizer-step hook's counting, each as a table or on real torch optimizers."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from stalwart import autostep, progress
from stalwart.config.hang import monitor_config
from stalwart.monitor import envvars, evidence, layout
from stalwart.monitor.auto import Rhythm
from stalwart.monitor.config import RHYTHM_WARMUP_STEPS
from stalwart.monitor.evidence import ProcSample, Role, StackLook
from stalwart.monitor.judge import Stalled, blame
from stalwart.monitor.suspicions import Bystander, Late, judged_with

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("first", "second", "hung"),
    [
        (("S", 1.0), ("S", 1.0), True),  # asleep in a wait, no CPU
        (("S", 1.0), ("S", 1.01), True),  # a few ms of CPU: still no code running
        (("T", 1.0), ("T", 1.0), True),  # stopped
        (("R", 1.0), ("T", 1.3), True),  # stopped by the second look
        (("S", 1.0), ("S", 1.2), False),  # data-loader workers or a thread ran code
        (("R", 1.0), ("R", 1.3), False),  # busy: evaluation, compilation
        (("D", 1.0), ("D", 1.0), False),  # uninterruptible I/O: a slow checkpoint
        (("S", 1.0), ("R", 1.0), False),  # running at the second look
    ],
)
def test_is_hung_table(first: tuple[str, float], second: tuple[str, float], hung: bool) -> None:
    a = ProcSample(10.0, *first)
    b = ProcSample(10.3, *second)
    assert evidence.is_hung(a, b) is hung


def test_a_busy_thread_or_child_means_not_hung() -> None:
    # The rank waits for its checkpoint writer, which is in I/O (D) or running.
    a = ProcSample(10.0, "S", 1.0, busy=True)
    b = ProcSample(10.3, "S", 1.0, busy=False)
    assert not evidence.is_hung(a, b) and not evidence.is_hung(b, a)
    assert evidence.is_hung(ProcSample(10.0, "T", 1.0, True), b)  # stopped is stopped


@pytest.mark.parametrize(
    ("woke", "hung"),
    [
        (0, True),  # one wait: a collective, sleep(3600), a blocked queue
        (1, True),  # a queue's periodic status check lands in the window
        (2, True),
        (3, False),  # a loop that naps between batches: an evaluation behind slow data
        (40, False),
    ],
)
def test_a_main_thread_that_keeps_waking_is_not_hung(woke: int, hung: bool) -> None:
    a = ProcSample(10.0, "S", 1.0, wakeups=100)
    b = ProcSample(10.3, "S", 1.0, wakeups=100 + woke)
    assert evidence.is_hung(a, b) is hung
    # Stopped stays hung whatever the counters say.
    assert evidence.is_hung(ProcSample(10.0, "T", 1.0, wakeups=0), b)


def test_sampled_wakeups_tell_a_napping_loop_from_one_long_wait() -> None:
    """Real processes: the same sleep call, in a loop of short naps or once."""
    import subprocess
    import sys

    loop = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.03)"])
    once = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        found: dict[int, bool] = {}
        deadline = time.monotonic() + 30
        while len(found) < 2 and time.monotonic() < deadline:
            for proc in (loop, once):
                a = evidence.sample(proc.pid, time.monotonic())
                time.sleep(evidence.CONFIRM_WAIT)
                b = evidence.sample(proc.pid, time.monotonic())
                assert a is not None and b is not None
                if a.state == b.state == "S" and b.cpu - a.cpu < 0.02:  # settled, quiet
                    found[proc.pid] = evidence.is_hung(a, b)
        assert found == {loop.pid: False, once.pid: True}
    finally:
        for proc in (loop, once):
            proc.kill()
            proc.wait()


def test_is_hung_needs_time_between_the_samples() -> None:
    a = ProcSample(10.0, "S", 1.0)
    assert not evidence.is_hung(a, a)


def _dump(*frames: tuple[str, str], other: tuple[str, str] | None = None) -> str:
    lines = []
    if other is not None:
        lines += ["Thread 0x00007f0000000002 (most recent call first):"]
        lines += [f'  File "{other[0]}", line 7 in {other[1]}', ""]
    lines += ["Current thread 0x00007f0000000001 (most recent call first):"]
    lines += [f'  File "{f}", line 12 in {fn}' for f, fn in frames]
    return "\n".join(lines) + "\n"


TORCH = "/venv/lib/python3.11/site-packages/torch"


@pytest.mark.parametrize(
    ("text", "stopped", "role"),
    [
        # DDP's reducer all-reduces inside backward: a victim.
        (
            _dump(
                (f"{TORCH}/autograd/graph.py", "_engine_run_backward"),
                (f"{TORCH}/autograd/__init__.py", "backward"),
                (f"{TORCH}/_tensor.py", "backward"),
                ("/job/train.py", "<module>"),
            ),
            False,
            Role.WAITING,
        ),
        (
            _dump(
                (f"{TORCH}/distributed/distributed_c10d.py", "all_reduce"),
                (f"{TORCH}/distributed/c10d_logger.py", "wrapper"),
                ("/job/train.py", "main"),
            ),
            False,
            Role.WAITING,
        ),
        (_dump((f"{TORCH}/cuda/__init__.py", "synchronize"), ("/j.py", "f")), False, Role.WAITING),
        # The program's own code (time.sleep has no Python frame), a data loader, I/O.
        (_dump(("/job/train.py", "<module>")), False, Role.ELSEWHERE),
        (
            _dump(("/job/data.py", "__getitem__"), (f"{TORCH}/utils/data/_utils/fetch.py", "f")),
            False,
            Role.ELSEWHERE,
        ),
        (
            _dump(("/usr/lib/python3.11/multiprocessing/queues.py", "get"), ("/j.py", "<module>")),
            False,
            Role.ELSEWHERE,
        ),
        # Stopped: not waiting on anyone, whatever the stack says.
        (_dump((f"{TORCH}/distributed/distributed_c10d.py", "barrier")), True, Role.ELSEWHERE),
        ("", True, Role.ELSEWHERE),
        ("", False, Role.UNKNOWN),
        # Only the main thread's stack counts, not a background thread in a collective.
        (
            _dump(
                ("/job/train.py", "<module>"),
                other=(f"{TORCH}/distributed/distributed_c10d.py", "all_reduce"),
            ),
            False,
            Role.ELSEWHERE,
        ),
    ],
)
def test_role_table(text: str, stopped: bool, role: Role) -> None:
    assert evidence.role(text, stopped).role is role


STALWART = "/venv/lib/python3.11/site-packages/stalwart"
_C10D = (f"{TORCH}/distributed/distributed_c10d.py", "all_reduce")
_SPIN = ("/job/loader.py", "spin")


def _block(tid: int, current: bool, *frames: tuple[str, str]) -> str:
    head = "Current thread" if current else "Thread"
    lines = [f"{head} 0x{tid:016x} (most recent call first):"]
    return "\n".join([*lines, *(f'  File "{f}", line 3 in {fn}' for f, fn in frames)]) + "\n"


@pytest.mark.parametrize(
    ("text", "role"),
    [
        # restore() agreeing on a step through the job's store (no process group): its
        # store.wait is C++, so stalwart's exchange is the innermost Python frame.
        (
            _dump(
                (f"{STALWART}/checkpoint/resume.py", "all_gather"),
                (f"{STALWART}/checkpoint/resume.py", "restore"),
                ("/job/train.py", "<module>"),
            ),
            Role.WAITING,
        ),
        # The signal landed on a busy worker thread (the main thread blocks it): the
        # main thread, listed last, is the one read, not the "Current thread".
        (_block(2, False, _SPIN) + _block(3, True, _SPIN) + _block(1, False, _C10D), Role.WAITING),
        (_block(2, True, _C10D) + _block(1, False, ("/job/train.py", "<module>")), Role.ELSEWHERE),
        # No thread marked current (the signal ran on a thread without Python): still last.
        (_block(2, False, _SPIN) + _block(1, False, _C10D), Role.WAITING),
        # Two dumps appended to one file: the first one counts.
        (
            _block(2, True, _SPIN) + _block(1, False, ("/job/train.py", "<module>"))
            + _block(2, False, _SPIN) + _block(1, True, _C10D),
            Role.ELSEWHERE,
        ),
        # faulthandler's "..." after 100 threads: the main thread is not in the dump.
        (_block(2, True, _C10D) + "...\n", Role.UNKNOWN),
        # A main thread with no Python frame to show.
        (_block(2, True, _C10D) + _block(1, False), Role.UNKNOWN),
    ],
)  # fmt: skip
def test_main_thread_and_store_wait_table(text: str, role: Role) -> None:
    assert evidence.role(text, False).role is role


# A rank whose program restores through the job's store (no process group; the peer
# never comes), its main thread blocking the stack signal the way code around a
# critical section may, and a worker thread spinning: the kernel hands the signal to
# another thread. No __main__ guard. stacks.install() stands in for the worker's
# bootstrap.
_STORE_WAITER = """
import signal, sys, threading
from datetime import timedelta
from torch.distributed import TCPStore
from stalwart.checkpoint.resume import restore
from stalwart.monitor import stacks

stacks.install()


def spin():
    while True:
        pass


threading.Thread(target=spin, daemon=True).start()
signal.pthread_sigmask(signal.SIG_BLOCK, {stacks.STACK_SIGNAL})
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(f"0x{threading.main_thread().ident:016x}", flush=True)
restore(sys.argv[1], rank=0, world_size=2, store=store, timeout_s=120)
"""


def test_a_rank_in_the_store_exchange_reads_as_waiting_whichever_thread_took_the_signal(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    from stalwart.base import procs
    from stalwart.monitor import stacks
    from tests.helpers import clean_env, wait_for

    script, dump = tmp_path / "restore_waiter.py", tmp_path / "stacks.txt"
    script.write_text(_STORE_WAITER)
    env = clean_env(**{envvars.STACKS_FILE: str(dump)})
    with subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None
            main_id = child.stdout.readline().strip()
            assert main_id.startswith("0x"), main_id

            def asked() -> str | None:
                procs.signal_pid(child.pid, stacks.STACK_SIGNAL)
                text = wait_for(lambda: dump.exists() and dump.read_text(), 10, "a dump")
                dump.write_text("")
                return text if "all_gather" in text else None

            wait_for(lambda: procs.catches_signal(child.pid, stacks.STACK_SIGNAL), 30, "handler")
            text = wait_for(asked, 30, "a dump taken inside the store exchange", interval=0.2)
        finally:
            child.kill()
    assert f"Current thread {main_id}" not in text  # the signal ran elsewhere
    reading = evidence.role(text, False)
    assert reading.role is Role.WAITING, reading
    assert "resume.py" in reading.where


def test_role_reads_hostile_and_oversized_stack_text_in_bounded_time() -> None:
    junk = "\x00\xff" * 4_000_000 + 'Current thread 0xZZ\n  File "' + "a" * 100_000
    started = time.monotonic()
    reading = evidence.role(junk, False)
    assert time.monotonic() - started < 5
    assert reading.role is Role.UNKNOWN
    # A frame line past the bound is never read.
    far = "x\n" * (evidence.MAX_STACK_CHARS // 2) + _dump((f"{TORCH}/autograd/graph.py", "x"))
    assert evidence.role(far, False).role is Role.UNKNOWN


def _stalled(rank: int, waiting: bool | None, since: float = 5.0, stopped: bool = False) -> Stalled:
    return Stalled(rank, rank, 40, since, since, stopped=stopped, waiting=waiting)


@pytest.mark.parametrize(
    ("ranks", "root"),
    [
        # The tie the issue saw (same iteration, same time): the stack decides.
        ([_stalled(0, True), _stalled(1, False)], 1),
        ([_stalled(0, False), _stalled(1, True)], 0),
        # Evidence wins over an older heartbeat of a waiting rank.
        ([_stalled(0, True, since=4.0), _stalled(1, False, since=5.0)], 1),
        # Without evidence that tells them apart: the old rules (oldest, lowest rank).
        ([_stalled(0, None), _stalled(1, None)], 0),
        ([_stalled(0, True), _stalled(1, True, since=4.0)], 1),
        ([_stalled(0, False), _stalled(1, False)], 0),
        ([_stalled(0, True), _stalled(1, None), _stalled(2, False)], 2),
    ],
)
def test_blame_on_evidence_table(ranks: list[Stalled], root: int) -> None:
    assert blame(ranks)[0].global_rank == root


@pytest.mark.parametrize(
    ("given", "hb_auto", "warmup", "needs_evidence"),
    [
        ({}, True, RHYTHM_WARMUP_STEPS, True),
        ({"auto_warmup_steps": "50"}, True, 50, True),
        ({"hb_timeout": "2"}, False, 100, False),  # numbers: exactly as configured
        ({"section_timeouts": ["ckpt=30"]}, False, 100, False),
        ({"hb_timeout": "auto"}, True, 100, True),
        ({"auto_progress": "false"}, False, 100, True),  # nothing seen, nothing judged
        ({"hb_timeout": "2", "evidence": "true"}, False, 100, True),
    ],
)
def test_defaulted_config_table(
    given: dict[str, object], hb_auto: bool, warmup: int, needs_evidence: bool
) -> None:
    cfg = monitor_config(given).defaulted()
    assert (cfg.hb_auto, cfg.auto_warmup_steps, cfg.needs_evidence) == (
        hb_auto,
        warmup,
        needs_evidence,
    )


def test_bad_evidence_value_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="evidence must be true or false, got 'maybe'"):
        monitor_config({"evidence": "maybe"})


def test_rhythm_counts_steps_by_iteration_when_no_heartbeat_count_is_kept() -> None:
    r = Rhythm()
    base = dict(
        pid=1, state=1, attach_time=1.0, oos_start=1.0, hb_initial_override=0.0,
        hb_override=0.0, oos_override=0.0, last_section=-1, name_count=0,
        open_times=(), limits=(),
    )  # fmt: skip
    r.observe(layout.SlotSnapshot(beats=0, last_hb=2.0, iteration=10, **base), [], 2.0, False)
    r.observe(layout.SlotSnapshot(beats=0, last_hb=2.1, iteration=11, **base), [], 2.1, False)
    r.observe(layout.SlotSnapshot(beats=0, last_hb=3.0, iteration=21, **base), [], 3.0, False)
    assert r.beats == 12
    # Ten steps in 0.9 s with the shortest seen 0.1 s: the longest one was 0.1 s, not 0.9.
    assert max(r.hb_gaps) == pytest.approx(0.1)
    # A scribbled iteration far ahead counts as one step and is not split into gaps.
    r.observe(layout.SlotSnapshot(beats=0, last_hb=4.0, iteration=10**12, **base), [], 4.0, False)
    assert r.beats == 13 and r.hb_gaps[-1] == pytest.approx(1.0)


# -- the hook, on real optimizers, writing into a real segment -------------------------
@pytest.fixture
def slots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    mm = layout.create_segment(tmp_path / "monitor.shm", 1)
    board = progress.ProgressBoard(tmp_path, 1)
    for k, v in board.worker_env(0).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(envvars.SHM_FILE, str(tmp_path / "monitor.shm"))
    monkeypatch.setenv(envvars.SLOT, "0")
    monkeypatch.delenv("STALWART_INJECT", raising=False)
    progress.reset()
    autostep.uninstall()
    autostep.install()
    yield mm, board
    autostep.uninstall()
    progress.reset()
    board.close()


def _model():  # type: ignore[no-untyped-def]
    import torch

    m = torch.nn.Linear(3, 1)
    m(torch.ones(2, 3)).sum().backward()
    return m


def test_each_optimizer_step_beats_the_slot_and_reports_progress(slots) -> None:  # type: ignore[no-untyped-def]
    import torch

    mm, board = slots
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    assert layout.read_slot(mm, 0).pid == 0  # nothing attached before the first step
    for _ in range(3):
        opt.step()
    snap = layout.read_slot(mm, 0)
    assert (snap.pid, snap.iteration, snap.state) == (os.getpid(), 3, layout.SlotState.ATTACHED)
    assert snap.last_hb > 0
    assert board.read()[0].first_step == 1 and board.read()[0].step == 3


def test_several_optimizers_count_one_step_per_pacemaker_step(slots) -> None:  # type: ignore[no-untyped-def]
    import torch

    mm, _ = slots
    m = _model()
    gen, disc = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(4):
        gen.step()
        disc.step()
    assert layout.read_slot(mm, 0).iteration == 4
    # A new optimizer (an in-process restart rebuilt the model) takes over at its second
    # step while the old one no longer steps; the count goes on.
    fresh = torch.optim.SGD(m.parameters(), lr=0.1)
    fresh.step()
    assert layout.read_slot(mm, 0).iteration == 4
    fresh.step()
    assert layout.read_slot(mm, 0).iteration == 5


def test_count_resumes_from_the_optimizers_own_step(slots) -> None:  # type: ignore[no-untyped-def]
    import torch

    mm, board = slots
    m = _model()
    opt = torch.optim.Adam(m.parameters())
    saved = torch.optim.Adam(m.parameters())
    autostep.uninstall()  # the steps of an earlier attempt, not seen by this one
    for _ in range(7):
        saved.step()
    opt.load_state_dict(saved.state_dict())
    autostep.install()
    opt.step()
    assert layout.read_slot(mm, 0).iteration == 8
    assert board.read()[0].first_step == 8


def test_checkpoint_creating_the_optimizer_state_is_not_a_step(slots) -> None:  # type: ignore[no-untyped-def]
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mm, board = slots
    m = _model()
    saved = torch.optim.Adam(m.parameters())
    autostep.uninstall()  # the steps of an earlier attempt, not seen by this one
    for _ in range(7):
        saved.step()
    saved_m, saved_o = get_state_dict(m, saved)
    autostep.install()
    # A restarted rank restores: torch creates the fresh optimizer's state with a step
    # of zero gradients at lr 0, first for the state dict to load into, then on loading.
    m.zero_grad(set_to_none=True)
    opt = torch.optim.Adam(m.parameters())
    get_state_dict(m, opt)
    set_state_dict(m, opt, model_state_dict=saved_m, optim_state_dict=saved_o)
    assert layout.read_slot(mm, 0).pid == 0  # the restore is no step: nothing attached
    assert 0 not in board.read()  # nor a step for goodput
    m(torch.ones(2, 3)).sum().backward()
    opt.step()
    assert layout.read_slot(mm, 0).iteration == 8  # counted on from the restored step
    assert board.read()[0].first_step == 8
    # A stateless optimizer gets that step at every save: never counted either.
    # (It takes over from Adam at its second step: steps 9 and 10.)
    m2 = _model()
    sgd = torch.optim.SGD(m2.parameters(), lr=0.1)
    for _ in range(3):
        sgd.step()
        sgd.zero_grad()
        get_state_dict(m2, sgd)
    assert layout.read_slot(mm, 0).iteration == 10


def test_program_signals_take_precedence(slots) -> None:  # type: ignore[no-untyped-def]
    import torch

    from stalwart.monitor import RankMonitorClient

    mm, board = slots
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    opt.step()
    progress.report(1000)  # the program reports its own steps (inject.step, a callback)
    opt.step()
    assert board.read()[0].step == 1000
    client = RankMonitorClient(install_stack_dump=False)
    client.init_workload_monitoring()
    client.report_iteration(77)
    opt.step()
    assert layout.read_slot(mm, 0).iteration == 77  # the client's slot, not the hook's
    client.shutdown_workload_monitoring()


def test_no_optimizer_attaches_nothing_and_off_switch_installs_nothing(
    slots, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    mm, board = slots
    assert layout.read_slot(mm, 0).pid == 0 and board.read() == {}
    autostep.uninstall()
    monkeypatch.setenv("STALWART_AUTO_PROGRESS", "0")
    autostep.install()
    import torch

    torch.optim.SGD(_model().parameters(), lr=0.1).step()
    assert layout.read_slot(mm, 0).pid == 0 and board.read() == {}


def test_a_slot_written_by_another_process_is_left_alone(slots) -> None:  # type: ignore[no-untyped-def]
    import torch

    mm, _ = slots
    layout.I64.pack_into(mm, layout.slot_offset(0) + layout.OFF_PID, 1)  # someone else's
    torch.optim.SGD(_model().parameters(), lr=0.1).step()
    assert layout.read_slot(mm, 0).pid == 1 and layout.read_slot(mm, 0).iteration == -1


# -- suspicions: the evidence cycle, with scripted samples ------------------------------
def _past(pids: dict[int, int], since: float = 1.0, due: float = 9.0) -> dict[int, Late]:
    """Ranks past their deadline `due`, silent since `since`."""
    return {lr: Late(pid, since, due, True) for lr, pid in pids.items()}


def _suspicions(states: dict[int, list[tuple[str, float]]], tmp_path: Path):  # type: ignore[no-untyped-def]
    from stalwart.monitor.suspicions import Suspicions, Watched

    calls: dict[int, int] = {}

    def sampler(pid: int, now: float) -> ProcSample | None:
        seq = states[pid]
        i = min(calls.get(pid, 0), len(seq) - 1)
        calls[pid] = calls.get(pid, 0) + 1
        return ProcSample(now, *seq[i])

    asked: list[int] = []
    files = {}
    for pid in (100, 101):
        f = tmp_path / f"stacks{pid}.log"
        f.write_text("old dump\n")
        files[pid] = f
    s = Suspicions(lambda pid: asked.append(pid) or True, sampler, wait=0.3)
    watched = {0: Watched(100, files[100]), 1: Watched(101, files[101])}
    return s, watched, asked, files


def test_suspicion_needs_evidence_and_holds_victims_for_their_culprit(tmp_path: Path) -> None:
    # Rank 0 waits in a collective, rank 1 sleeps in its own code; rank 1's deadline is
    # found one scan later than rank 0's.
    s, watched, asked, files = _suspicions({100: [("S", 1.0)], 101: [("S", 2.0)]}, tmp_path)
    assert s.confirm(_past({0: 100}), watched, 10.0) == {}
    assert sorted(asked) == [100, 101]  # everyone's stacks, at the first suspicion
    files[100].write_text(
        "old dump\n" + _dump((f"{TORCH}/autograd/graph.py", "_engine_run_backward"))
    )
    files[101].write_text("old dump\n" + _dump(("/job/train.py", "<module>")))
    assert s.confirm(_past({0: 100, 1: 101}), watched, 10.1) == {}
    # Rank 0 is hung (no CPU) but waits on peers while rank 1 is still suspected: held.
    assert s.confirm(_past({0: 100, 1: 101}), watched, 10.35) == {}
    assert s.confirm(_past({0: 100, 1: 101}), watched, 10.38) == {}
    found = s.confirm(_past({0: 100, 1: 101}), watched, 10.45)
    assert {lr: r.role for lr, r in found.items()} == {0: Role.WAITING, 1: Role.ELSEWHERE}
    assert "train.py" in found[1].where and "old dump" not in found[1].where


def test_a_waiter_is_never_handed_over_while_its_peer_is_busy(tmp_path: Path) -> None:
    # Rank 1 writes a slow checkpoint (busy), rank 0 waits for it in a collective.
    busy = [("S", 1.0 + 0.3 * i) for i in range(100)]
    s, watched, _, files = _suspicions({100: [("S", 1.0)], 101: busy}, tmp_path)
    s.confirm(_past({0: 100, 1: 101}), watched, 10.0)
    files[100].write_text(
        "old dump\n" + _dump((f"{TORCH}/distributed/distributed_c10d.py", "all_reduce"))
    )
    for k in range(1, 60):
        assert s.confirm(_past({0: 100, 1: 101}), watched, 10.0 + 0.1 * k) == {}


def test_a_busy_rank_is_never_confirmed(tmp_path: Path) -> None:
    cpu = [("R", 1.0 + 0.3 * i) for i in range(50)]
    s, watched, _, _ = _suspicions({100: cpu, 101: cpu}, tmp_path)
    for k in range(40):
        assert s.confirm(_past({0: 100}), watched, 10.0 + 0.1 * k) == {}


def test_a_rank_that_progresses_is_no_longer_suspected(tmp_path: Path) -> None:
    s, watched, _, _ = _suspicions({100: [("S", 1.0)], 101: [("S", 1.0)]}, tmp_path)
    s.confirm(_past({0: 100}), watched, 10.0)
    assert s.confirm(_past({}), watched, 10.2) == {}  # stepped again
    assert s.confirm(_past({0: 100}), watched, 10.4) == {}  # a new suspicion starts afresh
    assert s.confirm(_past({0: 100}), watched, 10.8) != {}


# -- the first look a window before the deadline; victims judged with their culprit -----
@pytest.mark.parametrize(
    ("first_at", "due", "decide"),
    [
        (9.7, 10.0, 10.0),  # looked a window early: decided at the deadline itself
        (10.0, 10.0, 10.3),  # first looked at the deadline: a window later
        (9.9, 10.0, 10.2),  # looked late: the window still separates the looks
        (9.0, 10.0, 10.0),  # looked long before: never decided before the deadline
    ],
)
def test_decision_at_table(first_at: float, due: float, decide: float) -> None:
    assert evidence.decision_at(first_at, due, 0.3) == pytest.approx(decide)


_W = evidence.Reading(Role.WAITING, "waiting on peers: barrier")
_E = evidence.Reading(Role.ELSEWHERE, "not waiting on peers: train.py")
_U = evidence.Reading(Role.UNKNOWN, "no stack")


@pytest.mark.parametrize(
    ("hung", "other", "judged"),
    [
        # The culprit is decided at its deadline; rank 0, waiting in the barrier since
        # before the episode asked for stacks (9.7), is judged at that same moment even
        # though its own deadline has not passed and it is not yet late.
        ({1: _E}, Bystander(False, 9.4, 9.7, _W), True),
        ({1: _E}, Bystander(True, 9.4, 9.7, _W), True),  # already late
        ({1: _E}, Bystander(True, 9.4, None, _U), True),  # late, its stack unread
        ({1: _U}, Bystander(False, 9.4, 9.7, _W), True),  # a culprit without a stack
        # It stepped after the ask: the stack it showed then is stale.
        ({1: _E}, Bystander(False, 9.8, 9.7, _W), False),
        ({1: _E}, Bystander(False, 9.4, 9.7, _E), False),  # at work elsewhere, not late
        ({1: _E}, Bystander(False, 9.4, 9.7, _U), False),
        ({1: _E}, Bystander(False, 9.4, None, _W), False),  # never asked this episode
        ({1: _E}, Bystander(False, None, 9.7, _W), False),  # no deadline runs
        # Only waiters hung (the culprit is elsewhere or busy): nobody joins them.
        ({1: _W}, Bystander(True, 9.4, 9.7, _W), False),
        ({}, Bystander(True, 9.4, 9.7, _W), False),
    ],
)
def test_judged_with_table(
    hung: dict[int, evidence.Reading], other: Bystander, judged: bool
) -> None:
    assert judged_with(hung, {0: other}) == ([0] if judged else [])
    assert judged_with(hung, {1: other}) == ([1] if judged and 1 not in hung else [])


def _since(watched: dict, since: float) -> dict:  # type: ignore[type-arg]
    return {lr: dataclasses.replace(w, since=since) for lr, w in watched.items()}


BARRIER = (f"{TORCH}/distributed/distributed_c10d.py", "barrier")


def test_a_hung_rank_is_decided_at_its_deadline_with_its_victim(tmp_path: Path) -> None:
    # Rank 1 is stopped; rank 0 waits in a barrier and its deadline falls just after
    # rank 1's (it wrote its heartbeat later): both are judged when rank 1 is decided.
    s, watched, asked, files = _suspicions({100: [("S", 1.0)], 101: [("T", 1.0)]}, tmp_path)
    watched = _since(watched, 9.4)
    assert s.confirm({1: Late(101, 9.4, 10.0, False)}, watched, 9.7) == {}  # samples only
    assert asked == [100]  # stacks asked then (a stopped rank stays stopped)
    assert s.next_look() == pytest.approx(10.0)
    files[100].write_text(files[100].read_text() + _dump(BARRIER))
    found = s.confirm({1: Late(101, 9.4, 10.0, True)}, watched, 10.0)
    assert {lr: r.role for lr, r in found.items()} == {0: Role.WAITING, 1: Role.ELSEWHERE}
    assert "stopped" in found[1].where and "barrier" in found[0].where
    assert s.next_look() is None


def test_a_late_victim_is_judged_before_its_second_look(tmp_path: Path) -> None:
    s, watched, _, files = _suspicions({100: [("S", 1.0)], 101: [("T", 1.0)]}, tmp_path)
    watched = _since(watched, 9.4)
    s.confirm({1: Late(101, 9.4, 10.0, False)}, watched, 9.7)
    files[100].write_text(files[100].read_text() + _dump(BARRIER))
    late = {1: Late(101, 9.4, 10.0, False), 0: Late(100, 9.45, 10.05, False)}
    assert s.confirm(late, watched, 9.8) == {}
    late = {1: Late(101, 9.4, 10.0, True), 0: Late(100, 9.45, 10.05, False)}
    assert sorted(s.confirm(late, watched, 10.0)) == [0, 1]


def test_a_peer_that_stepped_since_the_ask_or_sent_garbage_is_left(tmp_path: Path) -> None:
    s, watched, _, files = _suspicions({100: [("S", 1.0)], 101: [("T", 1.0)]}, tmp_path)
    s.confirm({1: Late(101, 9.4, 10.0, False)}, _since(watched, 9.4), 9.7)
    files[100].write_text(files[100].read_text() + _dump(BARRIER))
    found = s.confirm({1: Late(101, 9.4, 10.0, True)}, _since(watched, 9.8), 10.0)
    assert sorted(found) == [1]
    # Late again by then, it is judged with rank 1, but not on the stack it had before
    # it stepped: that one says nothing of where it is now.
    s, watched, _, files = _suspicions({100: [("S", 1.0)], 101: [("T", 1.0)]}, tmp_path)
    s.confirm({1: Late(101, 9.4, 10.0, False)}, _since(watched, 9.4), 9.7)
    files[100].write_text(files[100].read_text() + _dump(("/job/train.py", "<module>")))
    late = {1: Late(101, 9.4, 10.0, True), 0: Late(100, 9.8, 10.4, False)}
    found = s.confirm(late, _since(watched, 9.8), 10.0)
    assert sorted(found) == [0, 1] and found[0].role is Role.UNKNOWN
    # Hostile, oversized stacks (a rank writes its own stderr): no stack, not judged.
    s, watched, _, files = _suspicions({100: [("S", 1.0)], 101: [("T", 1.0)]}, tmp_path)
    s.confirm({1: Late(101, 9.4, 10.0, False)}, _since(watched, 9.4), 9.7)
    with open(files[100], "ab") as f:
        f.write(b"\xff\x00" * evidence.MAX_STACK_CHARS + _dump(BARRIER).encode())
    found = s.confirm({1: Late(101, 9.4, 10.0, True)}, _since(watched, 9.4), 10.0)
    assert sorted(found) == [1]


def test_an_early_look_that_finds_progress_is_discarded(tmp_path: Path) -> None:
    s, watched, _, _ = _suspicions({100: [("S", 1.0)], 101: [("S", 1.0)]}, tmp_path)
    assert s.confirm({0: Late(100, 9.4, 10.0, False)}, watched, 9.7) == {}
    # It stepped at 9.9 and is late again by 10.2: the look at 9.7 saw another stall.
    assert s.confirm({0: Late(100, 9.9, 10.5, False)}, watched, 10.2) == {}
    assert s.confirm({0: Late(100, 9.9, 10.5, True)}, watched, 10.4) == {}  # 0.2 s apart
    assert s.next_look() == pytest.approx(10.5)
    assert s.confirm({0: Late(100, 9.9, 10.5, True)}, watched, 10.5) != {}


def test_a_rank_that_resumes_between_the_looks_is_not_hung(tmp_path: Path) -> None:
    # Late at 9.7, running code by the deadline (CPU used between the looks): looked at
    # again a window later, not killed; then it steps and is no longer suspected.
    s, watched, _, _ = _suspicions({100: [("S", 1.0), ("R", 1.2)], 101: [("S", 1.0)]}, tmp_path)
    assert s.confirm({0: Late(100, 9.4, 10.0, False)}, watched, 9.7) == {}
    assert s.confirm({0: Late(100, 9.4, 10.0, True)}, watched, 10.0) == {}
    assert s.next_look() == pytest.approx(10.3)
    assert s.confirm({}, watched, 10.1) == {} and s.next_look() is None


_QUIET = ProcSample(10.0, "S", 1.0)  # the ask's sample of a rank asleep in a wait
_WORKING = ProcSample(10.0, "R", 1.0)  # ... of a rank at work (its CPU goes on below)


@pytest.mark.parametrize(
    ("stopped", "can_ask", "at_ask", "now", "dumped", "look"),
    [
        # Stopped: its state is the evidence; no stacks file: nothing to ask for.
        (True, True, _WORKING, ProcSample(10.4, "T", 2.0), False, StackLook.READ),
        (False, False, None, ProcSample(10.4, "S", 1.0), False, StackLook.READ),
        # Quiet since the ask: that dump shows where it is stuck.
        (False, True, _QUIET, ProcSample(10.4, "S", 1.0), True, StackLook.READ),
        # Asked while it worked (CPU ran since), quiet only now: ask again.
        (False, True, _WORKING, ProcSample(10.4, "S", 1.3), True, StackLook.ASK),
        (False, True, None, ProcSample(10.4, "S", 1.0), False, StackLook.ASK),  # never asked
        # Asked again with the sample that found it hung: wait for that dump, bounded.
        (False, True, ProcSample(10.4, "S", 1.3), ProcSample(10.45, "S", 1.3), False,
         StackLook.WAIT),
        (False, True, ProcSample(10.4, "S", 1.3), ProcSample(10.45, "S", 1.3), True,
         StackLook.READ),
        (False, True, ProcSample(10.4, "S", 1.3), ProcSample(11.5, "S", 1.3), False,
         StackLook.READ),
        (False, True, _QUIET, ProcSample(10.0, "S", 1.0), False, StackLook.WAIT),  # same look
    ],
)  # fmt: skip
def test_stack_look_table(
    stopped: bool,
    can_ask: bool,
    at_ask: ProcSample | None,
    now: ProcSample,
    dumped: bool,
    look: StackLook,
) -> None:
    assert evidence.stack_look(stopped, can_ask, at_ask, now, dumped) is look
    if look is StackLook.WAIT:  # no patience (the episode's own ask): what is there
        assert evidence.stack_look(stopped, can_ask, at_ask, now, dumped, 0.0) is StackLook.READ


def test_a_rank_busy_at_the_ask_that_waits_later_is_judged_on_a_fresh_dump(
    tmp_path: Path,
) -> None:
    # A restarted job restores: both ranks are busy when the episode asks for stacks;
    # rank 0 finishes first and waits in a collective on rank 1, which still reads.
    restoring = _dump(("/job/train.py", "load_state_dict"))
    busy = [("R", 1.0 + 0.3 * i) for i in range(100)]
    s, watched, asked, files = _suspicions(
        {100: [("R", 1.0), ("R", 1.5), ("R", 2.0), ("S", 2.0)], 101: busy}, tmp_path
    )
    assert s.confirm(_past({0: 100, 1: 101}), watched, 10.0) == {}
    for f in files.values():
        f.write_text(f.read_text() + restoring)
    assert s.confirm(_past({0: 100, 1: 101}), watched, 10.3) == {}  # both running code
    # Rank 0 is quiet now, but its dump was written while it worked: asked again.
    assert s.confirm(_past({0: 100, 1: 101}), watched, 10.7) == {}
    assert asked == [100, 101, 100]
    assert s.next_look() == pytest.approx(10.7 + evidence.DUMP_POLL)
    files[100].write_text(
        files[100].read_text() + _dump((f"{TORCH}/distributed/distributed_c10d.py", "all_gather"))
    )
    # Judged on the fresh dump: it waits on its peers, so it is held while rank 1 works.
    for k in range(1, 30):
        assert s.confirm(_past({0: 100, 1: 101}), watched, 10.7 + 0.05 * k) == {}


def test_each_episode_asks_for_fresh_stacks(tmp_path: Path) -> None:
    # A slow phase made rank 1 late and ended; its dump must not be read for a later
    # hang, so the next episode asks again and reads what follows that ask.
    s, watched, asked, files = _suspicions({100: [("S", 1.0)], 101: [("S", 1.0)]}, tmp_path)
    s.confirm({1: Late(101, 5.0, 6.0, False)}, watched, 5.7)
    files[101].write_text(files[101].read_text() + _dump(("/job/eval.py", "evaluate")))
    assert s.confirm({}, watched, 5.9) == {}
    s.confirm({1: Late(101, 9.4, 10.0, False)}, watched, 9.7)
    assert asked == [100, 101, 100, 101]
    files[101].write_text(files[101].read_text() + _dump(("/job/train.py", "load_batch")))
    found = s.confirm({1: Late(101, 9.4, 10.0, True)}, watched, 10.0)
    assert "train.py" in found[1].where and "eval.py" not in found[1].where


def _taking_turns(tmp_path: Path, turn: float):  # type: ignore[no-untyped-def]
    """Two ranks of a DCP save: until `turn` rank 0 waits in a collective (quiet) while
    rank 1 writes its shards (busy); from then on rank 0, the coordinator, copies the
    step into RAM (busy) while rank 1 waits for its answer (quiet). `turn` None: both
    wait from the start (a deadlock)."""
    from stalwart.monitor.suspicions import Suspicions, Watched

    def sampler(pid: int, now: float) -> ProcSample:
        if turn is None:
            return ProcSample(now, "S", 1.0)
        works = (pid == 101) == (now < turn)
        # CPU seconds so far: rank 1 works until the turn, rank 0 from it on.
        cpu = 1.0 + (min(now, turn) if pid == 101 else max(0.0, now - turn))
        return ProcSample(now, "R" if works else "S", cpu)

    asked: list[int] = []
    files = {pid: tmp_path / f"stacks{pid}.log" for pid in (100, 101)}
    for f in files.values():
        f.write_text("")
    s = Suspicions(lambda pid: asked.append(pid) or True, sampler, wait=0.3)
    return s, {0: Watched(100, files[100]), 1: Watched(101, files[101])}, asked, files


def test_ranks_that_take_turns_waiting_are_never_handed_over_together(tmp_path: Path) -> None:
    # Seen under bench_dcp's crash section at load 18-22 (2 of 4 runs): rank 0 was held
    # as waiting while rank 1 wrote, then copied the step while rank 1 waited, and the
    # stale verdict was handed over with rank 1's: both killed in a save that went on.
    s, watched, asked, files = _taking_turns(tmp_path, turn=11.0)
    waits = _dump((f"{TORCH}/distributed/distributed_c10d.py", "all_gather"))
    writes = _dump(("/job/ckpt.py", "write_data"))
    got: list[dict[int, object]] = []
    for k in range(60):
        now = 10.0 + 0.05 * k
        got.append(dict(s.confirm(_past({0: 100, 1: 101}), watched, now)))
        for pid, before, after in ((100, waits, writes), (101, writes, waits)):
            if asked.count(pid) > files[pid].read_text().count("Current"):  # it dumps
                files[pid].write_text(files[pid].read_text() + (before if now < 11.0 else after))
    assert asked.count(101) >= 2  # rank 1 was found quiet, and asked again for its stack
    assert all(found == {} for found in got), got


def test_ranks_that_all_wait_are_still_handed_over_together(tmp_path: Path) -> None:
    s, watched, asked, files = _taking_turns(tmp_path, turn=None)
    waits = _dump((f"{TORCH}/distributed/distributed_c10d.py", "all_reduce"))
    found: dict[int, object] = {}
    for k in range(40):
        if not found:
            found = dict(s.confirm(_past({0: 100, 1: 101}), watched, 10.0 + 0.05 * k))
        for pid in (100, 101):
            if asked.count(pid) > files[pid].read_text().count("Current"):
                files[pid].write_text(files[pid].read_text() + waits)
    assert {lr: r.role for lr, r in found.items()} == {0: Role.WAITING, 1: Role.WAITING}
