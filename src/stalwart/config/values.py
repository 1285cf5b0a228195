"""Text (or a YAML value) -> one typed setting; a bad value is a ``ConfigError`` naming it."""

from __future__ import annotations

import os
import re
from typing import Any


class ConfigError(ValueError):
    """A bad setting; the message is one line that names the value and what was expected."""


def parse_nnodes(value: str) -> tuple[int, int]:
    lo, sep, hi = value.partition(":")
    try:
        a = int(lo)
        b = int(hi) if sep else a
    except ValueError:
        raise ConfigError(
            f"--nnodes {value!r}: expected N or MIN:MAX (positive integers)"
        ) from None
    if a < 1 or b < a:
        raise ConfigError(f"--nnodes {value!r}: expected 1 <= MIN <= MAX")
    return a, b


def _cpus() -> int:
    # torchrun's count: the CPUs this process may run on (taskset, cgroup cpusets).
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def parse_nproc(value: str) -> int:
    if value == "cpu":
        return _cpus()
    if value in ("auto", "gpu", "xpu"):
        import torch

        if value == "auto":  # as torchrun: one per accelerator, else one per CPU
            acc = torch.accelerator
            return acc.device_count() if acc.is_available() else _cpus()
        dev = torch.cuda if value == "gpu" else torch.xpu
        n = dev.device_count() if dev.is_available() else 0
        if n == 0:
            kind = "CUDA" if value == "gpu" else "XPU"
            raise ConfigError(f"--nproc-per-node {value}: no {kind} device is visible on this node")
        return n
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(
            f"--nproc-per-node {value!r}: expected a positive integer, auto, cpu, gpu or xpu"
        ) from None
    if n < 1:
        raise ConfigError(f"--nproc-per-node {value!r}: expected a positive integer")
    return n


def parse_signals(value: str, name: str) -> tuple[str, ...]:
    """torchrun's ``SIGTERM,SIGUSR1`` list: the names, checked (torchrun skips a bad one
    with a warning; here it is an error naming it)."""
    import signal

    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if not names:
        raise ConfigError(f"{name} {value!r}: expected signal names like SIGTERM,SIGUSR1")
    for n in names:
        sig = getattr(signal, n, None) if n.startswith("SIG") and "_" not in n else None
        if not isinstance(sig, signal.Signals):
            raise ConfigError(f"{name} {value!r}: {n!r} is not a signal name (like SIGUSR1)")
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"{name} {value!r}: {n} cannot be handled")
    return names


_EXCEPTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def parse_exception_names(value: Any, name: str) -> tuple[str, ...]:
    """``ImportError,SyntaxError`` (or a YAML list): exception type names, each a Python
    name or dotted path, at most 64 of them."""
    names = tuple(dict.fromkeys(parse_list(value)))
    if len(names) > 64:
        raise ConfigError(f"{name}: {len(names)} names; expected at most 64")
    for n in names:
        if len(n) > 200 or not _EXCEPTION_NAME.fullmatch(n):
            raise ConfigError(
                f"{name} {n[:80]!r}: expected exception type names like ImportError,SyntaxError"
            )
    return names


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
}


def parse_size(value: str | int, flag: str) -> int:
    """``"512MiB"``, ``"2G"``, ``"1.5GiB"`` or a byte count -> bytes (K/M/G alone are binary)."""
    if isinstance(value, int) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        text = str(value).strip().lower().replace(" ", "")
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        number_text, unit = digits, text[len(digits) :]
        try:
            number = float(number_text)
        except ValueError:
            number = -1.0
    if unit not in _SIZE_UNITS or not 0 <= number < float("inf"):
        raise ConfigError(f"{flag} {value!r}: expected a size such as 512MiB, 2GiB or 0 (off)")
    return int(number * _SIZE_UNITS[unit])


def parse_kv(value: str, flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in value.split(","))):
        k, eq, v = item.partition("=")
        if not eq or not k:
            raise ConfigError(f"{flag} {value!r}: expected key=value[,key=value...]")
        out[k.strip()] = v.strip()
    return out


def parse_list(value: Any) -> list[str]:
    """A YAML list, or ``"a,b"`` from a flag or the environment."""
    if isinstance(value, list):
        return [str(x) for x in value]
    return [x.strip() for x in str(value).split(",") if x.strip()]


def is_false(value: Any) -> bool:
    """``warm: false``, ``STALWART_WARM=0``: the spellings that switch a default-on setting off."""
    return str(value).lower() in ("0", "false", "no")


#: The longest quarantine window (failed rounds) and hold (seconds) accepted.
MAX_QUARANTINE_WINDOW = 10_000
MAX_QUARANTINE_HOLD = 365 * 86400.0


def parse_quarantine_after(value: str) -> tuple[int, int] | None:
    """``--quarantine-after K/M`` (implicated in K of the last M failed rounds), or
    ``off``."""
    if value.strip().lower() == "off":
        return None
    k, sep, m = value.partition("/")
    try:
        after, window = int(k), int(m)
    except ValueError:
        raise ConfigError(f"--quarantine-after {value!r}: expected K/M (e.g. 3/5) or off") from None
    if not sep or not 1 <= after <= window <= MAX_QUARANTINE_WINDOW:
        raise ConfigError(
            f"--quarantine-after {value!r}: expected K/M with 1 <= K <= M <= "
            f"{MAX_QUARANTINE_WINDOW}, or off"
        )
    return after, window


def parse_quarantine_for(value: str) -> float | None:
    """``--quarantine-for SECONDS`` until a quarantined node may rejoin, or ``never``."""
    if value.strip().lower() == "never":
        return None
    try:
        hold = float(value)
    except ValueError:
        hold = -1.0
    if not 0 < hold <= MAX_QUARANTINE_HOLD:  # also false for nan
        raise ConfigError(
            f"--quarantine-for {value!r}: expected seconds > 0 and <= "
            f"{MAX_QUARANTINE_HOLD:g}, or never"
        )
    return hold
