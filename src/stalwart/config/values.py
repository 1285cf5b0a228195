"""Text (or a YAML value) -> one typed setting; a bad value is a ``ConfigError`` naming it."""

from __future__ import annotations

import os
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


def parse_nproc(value: str) -> int:
    if value in ("auto", "cpu"):
        return os.cpu_count() or 1
    if value == "gpu":
        import torch

        n = torch.cuda.device_count()
        if n == 0:
            raise ConfigError("--nproc-per-node gpu: no CUDA device is visible on this node")
        return n
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(
            f"--nproc-per-node {value!r}: expected a positive integer, auto, cpu or gpu"
        ) from None
    if n < 1:
        raise ConfigError(f"--nproc-per-node {value!r}: expected a positive integer")
    return n


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
