"""The hang dossier: what every local rank was doing when a hang was detected.

At the first hang of an attempt the node monitor asks every local rank (not only the
hung one) for its Python stacks, asks torch's NCCL flight recorder for a dump where the
job enabled it, and, before any signal that kills, writes one text file into the run
folder: per rank its state read from its slot (section, iteration, heartbeat age) and
the stacks it wrote. The summary points at that file.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import time
from collections.abc import Mapping
from pathlib import Path

from stalwart.monitor.layout import SlotSnapshot, SlotState

#: torch's NCCL flight recorder reads a byte from ``<stem><rank>.pipe`` (a FIFO it made)
#: as a request to dump its trace; only when its trace buffer is enabled.
FR_PIPE_ENV = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
FR_BUFFER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
FR_DUMP_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
FR_DUMP_DEFAULT = "/tmp/nccl_trace_rank_"


def dossier_name(attempt: int | None) -> str:
    return f"hang-dossier-attempt{attempt if attempt is not None else 'x'}.txt"


def describe(snap: SlotSnapshot, names: list[str], now: float, floor: float = 0.0) -> str:
    """One line on what a rank was doing, from its slot (pure)."""
    if snap.state != SlotState.ATTACHED or snap.pid <= 0:
        return "no monitoring client attached"

    def age(t: float) -> str | None:
        return f"{now - t:.3f}s" if floor <= t <= now + 1.0 and t > 0 else None

    bits = []
    bits.append(f"iteration {snap.iteration}" if snap.iteration >= 0 else "no iteration reported")
    hb = age(snap.last_hb)
    bits.append(f"last heartbeat {hb} ago" if hb else "no heartbeat yet")
    open_ = []
    for idx in range(max(0, min(snap.name_count, len(names), len(snap.open_times)))):
        opened = age(snap.open_times[idx])
        if snap.open_times[idx] > 0:
            open_.append(f"{names[idx]!r} for {opened}" if opened else repr(names[idx]))
    if open_:
        bits.append("in section " + ", ".join(open_))
    else:
        oos = age(snap.oos_start)
        bits.append(f"out of any section for {oos}" if oos else "out of any section")
    return "; ".join(bits)


def flight_recorder_pipe(env: Mapping[str, str], global_rank: int) -> Path | None:
    """The FIFO torch's flight recorder of `global_rank` listens on, when enabled."""
    stem = env.get(FR_PIPE_ENV, "")
    try:
        size = int(env.get(FR_BUFFER_ENV, "0") or "0")
    except ValueError:
        size = 0
    if not stem or size <= 0 or global_rank < 0:
        return None
    return Path(f"{stem}{global_rank}.pipe")


def request_flight_recorder_dump(pipe: Path) -> bool:
    """Writes one byte into the rank's dump FIFO; False when nobody listens there.

    Non-blocking and only into a FIFO: a regular file or a missing reader is left alone.
    """
    try:
        if not stat.S_ISFIFO(os.stat(pipe).st_mode):
            return False
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:  # absent, or ENXIO: no reader has it open
        return False
    try:
        os.write(fd, b"1")
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


@dataclasses.dataclass
class RankEntry:
    local_rank: int
    global_rank: int
    pid: int
    state: str
    verdict: str | None = None  # set for ranks found hung
    stderr: Path | None = None
    stderr_offset: int | None = None
    stacks_signalled: bool = False
    flight_recorder: Path | None = None


def render(attempt: int | None, entries: list[RankEntry], read_max: int) -> str:
    """The dossier's text: a header, then each rank's state and the stacks it wrote."""
    lines = [
        f"stalwart hang dossier, attempt {attempt}, written "
        f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
        "",
    ]
    for e in sorted(entries, key=lambda x: x.global_rank):
        lines.append(
            f"== rank {e.global_rank} (local rank {e.local_rank}, pid {e.pid}): "
            + (f"HUNG: {e.verdict}" if e.verdict else "not found hung")
        )
        lines.append(f"   doing: {e.state}")
        if e.flight_recorder is not None:
            dump = os.environ.get(FR_DUMP_ENV, FR_DUMP_DEFAULT)
            lines.append(
                f"   flight recorder dump requested via {e.flight_recorder} "
                f"(written to {dump}{e.global_rank})"
            )
        lines.append(_stacks(e, read_max))
        lines.append("")
    return "\n".join(lines)


def _stacks(e: RankEntry, read_max: int) -> str:
    if not e.stacks_signalled:
        return "   (no stacks: the rank has no stack-dump handler)"
    if e.stderr is None or e.stderr_offset is None:
        return (
            "   (stacks went to the console: the rank's stderr is not a file, see -r/--redirects)"
        )
    try:
        with open(e.stderr, "rb") as f:
            f.seek(e.stderr_offset)
            text = f.read(read_max).decode("utf-8", "replace").rstrip()
    except OSError as exc:
        return f"   (could not read stacks from {e.stderr}: {exc.strerror})"
    return text if text else "   (no stacks written in time)"
