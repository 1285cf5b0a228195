"""Hang detection's settings, parsed once: text from flags, YAML and the environment
becomes the monitor's typed `MonitorConfig` here, and nowhere else.

`layers.monitor_settings` gathers the raw values (keyed by the record's field names);
`monitor_config` turns them into the record the launcher hands down.  Every error is one
line naming the setting and the value, prefixed ``hang detection:``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from stalwart.config.values import ConfigError
from stalwart.monitor.config import MonitorConfig, parse_signal

#: The value that asks for a learned timeout instead of a number.
AUTO = "auto"
# Which record flag a timeout's ``auto`` turns on.
_AUTO_OF = {"hb_timeout": "hb_auto", "out_of_section_timeout": "oos_auto"}
#: Settings that are numbers without a unit (not seconds).
_PLAIN_NUMBERS = ("safety_factor", "auto_percentile", "straggler_factor")
_BOOLEANS = (
    "hb_auto",
    "section_auto",
    "oos_auto",
    "straggler_restart",
    "auto_progress",
    "evidence",
)
# A setting's text longer than this is not a number anyone meant: named, not echoed whole.
_MAX_ECHO = 80


def _shown(raw: Any) -> str:
    text = repr(raw)
    return text if len(text) <= _MAX_ECHO else f"{text[:_MAX_ECHO]}... ({len(text)} characters)"


def _float(raw: Any) -> float | None:
    if isinstance(raw, bool):
        return None
    try:
        return float(raw)
    except (TypeError, ValueError, OverflowError):
        return None


def _positive(name: str, raw: Any, unit: str) -> float:
    """A positive number, naming `name` (and the unit, if any) in the error."""
    value = _float(raw)
    if value is None:
        kind = f"a number of {unit}" if unit else "a number"
        raise ValueError(f"{name} must be {kind}, got {_shown(raw)}")
    if math.isnan(value) or value <= 0:
        raise ValueError(f"{name} must be > 0{' ' + unit if unit else ''}, got {value!r}")
    return value


def parse_number(name: str, raw: Any) -> float:
    """A positive plain number (no unit), naming `name` in the error."""
    return _positive(name, raw, "")


def parse_seconds(name: str, raw: Any) -> float:
    """A positive number of seconds, naming `name` in the error."""
    return _positive(name, raw, "seconds")


def parse_section_timeout(spec: str) -> tuple[str, float]:
    """One ``name=secs`` section timeout, as given to ``--section-timeout``."""
    name, sep, secs = spec.partition("=")
    name = name.strip()
    if not sep or not name or not secs.strip():
        raise ValueError(f"section timeout must look like name=seconds, got {_shown(spec)}")
    return name, parse_seconds(f"section timeout {name!r}", secs.strip())


def _parse_bool(name: str, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be true or false, got {_shown(raw)}")


def _is_auto(raw: Any) -> bool:
    return isinstance(raw, str) and raw.strip().lower() == AUTO


def _parse_sections(raw: Any) -> tuple[dict[str, float], bool]:
    """Section timeouts and whether ``auto`` (learn every other section) was among them."""
    if _is_auto(raw):
        return {}, True
    if isinstance(raw, Mapping):
        return {str(k): parse_seconds(f"section timeout {k!r}", v) for k, v in raw.items()}, False
    if isinstance(raw, str):
        items = [part for part in raw.split(",") if part.strip()]
    elif isinstance(raw, list | tuple):
        items = [str(part) for part in raw]
    else:
        raise ValueError(f"section_timeouts must be a mapping or name=secs list, got {_shown(raw)}")
    given = [item for item in items if not _is_auto(item)]
    return dict(parse_section_timeout(item) for item in given), len(given) < len(items)


def _whole(name: str, raw: Any) -> int:
    try:
        return int(str(raw))
    except ValueError:
        raise ValueError(f"{name} must be a whole number, got {_shown(raw)}") from None


def _seconds_or_zero(name: str, raw: Any) -> float:
    value = _float(raw)
    if value is None:
        raise ValueError(f"{name} must be a number of seconds, got {_shown(raw)}")
    return value


def _fields(data: Mapping[str, Any]) -> dict[str, Any]:
    """The record's keyword arguments from text; raises ValueError naming the setting."""
    known = {f.name for f in dataclasses.fields(MonitorConfig)}
    unknown = sorted(str(k) for k in set(data) - known)
    if unknown:
        raise ValueError(
            f"unknown monitor setting(s): {', '.join(_shown(k)[1:-1] for k in unknown)}"
        )
    kwargs: dict[str, Any] = {}
    for key, raw in data.items():
        if raw is None:
            continue
        if key in _AUTO_OF and _is_auto(raw):
            kwargs[_AUTO_OF[key]] = True
        elif key == "section_timeouts":
            kwargs[key], auto = _parse_sections(raw)
            if auto:
                kwargs["section_auto"] = True
        elif key in _BOOLEANS:
            kwargs[key] = _parse_bool(key, raw)
        elif key == "auto_warmup_steps":
            kwargs[key] = _whole(key, raw)
        elif key in ("auto_warmup_seconds", "stack_dump_wait"):
            # Zero is allowed for these; the record rejects a negative value.
            kwargs[key] = _seconds_or_zero(key, raw)
        elif key in _PLAIN_NUMBERS:
            kwargs[key] = parse_number(key, raw)
        elif key == "term_signal":
            kwargs[key] = parse_signal(raw)
        else:
            kwargs[key] = parse_seconds(key, raw)
    return kwargs


def monitor_config(data: Mapping[str, Any]) -> MonitorConfig:
    """The monitor's record from YAML/env/flag values (strings accepted everywhere).

    ``section_timeouts`` may be a mapping, a list of ``name=secs`` strings or one
    comma-separated string of them.  With no timeout configured at all, hang detection
    is learned from the job's own steps (`MonitorConfig.defaulted`).
    """
    try:
        return MonitorConfig(**_fields(data)).defaulted()
    except ValueError as err:
        raise ConfigError(f"hang detection: {err}") from None
