"""NVIDIA's `FaultToleranceConfig` (nvidia-resiliency-ext 0.4.1) for code written against
it: the record with NVIDIA's field names, order and defaults, built from keyword
arguments (`from_kwargs`), a YAML file's `fault_tolerance:` section (`from_yaml_file`)
or `--ft-*` options (`add_arguments`, `from_args`), and written back (`to_yaml_file`).

stalwart's own settings are `stalwart run`'s flags and `--config` file
(stalwart.config); this record is what a program that starts its own rank monitor
hands `RankMonitorServer.run_in_subprocess`. Fields that stalwart does not act on (the
launcher's NIC and node-health settings, the restart check, the log level) are checked
and kept, so that a user's file loads and writes back as it was;
docs/migrating.md names them. Each field is declared once below; its check, its YAML
key and its `--ft-*` option are derived from that declaration.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import logging
import math
import os
import signal
from collections.abc import Iterator, Mapping
from dataclasses import field
from pathlib import Path
from typing import Any

from stalwart.base.yamlfile import read_yaml
from stalwart.monitor import layout
from stalwart.monitor.config import MonitorConfig, parse_signal
from stalwart.monitor.timeouts_in_force import Configured

log = logging.getLogger(__name__)

#: The section a YAML file holds the settings in (at the top or nested anywhere).
SECTION = "fault_tolerance"
#: Prefix of the argparse option (and namespace attribute) of each field.
OPTION_PREFIX = "ft"

_LOG_LEVELS = {
    "DEBUG": logging.DEBUG,
    "DBG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
    "FATAL": logging.CRITICAL,
}


class SectionMissing(ValueError):
    """A YAML file without a non-empty `fault_tolerance:` section."""


class Kind(enum.Enum):
    """What a field holds; decides its check and its `--ft-*` option's parsing."""

    TIMEOUT = "None or a number of seconds > 0"
    SECONDS = "a finite number of seconds > 0"
    FACTOR = "a finite number > 0"
    SECTIONS = "a mapping of section names to None or seconds > 0"
    SIGNAL = "a signal name (SIGKILL) or number"
    LOG_LEVEL = "a log level name (DEBUG, INFO, WARNING, ERROR, CRITICAL) or number 10..50"
    FLAG = "true or false"
    TEXT = "None or a string"


def _meta(kind: Kind, acted_on: bool) -> dict[str, Any]:
    return {"kind": kind, "acted_on": acted_on}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


def shown(value: Any) -> str:
    """`repr(value)`, cut short: a hostile file's value must not become a huge message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bad(name: str, kind: Kind, value: Any) -> ValueError:
    return ValueError(f"{name} must be {kind.value}, got {shown(value)}")


def check(name: str, kind: Kind, value: Any) -> Any:
    """`value` as field `name` of kind `kind` holds it, or ValueError naming the field,
    what was expected and what was given (one line)."""
    if kind is Kind.TIMEOUT:
        if value is None:
            return None
        if not _number(value) or not value > 0:
            raise _bad(name, kind, value)
        return float(value)
    if kind in (Kind.SECONDS, Kind.FACTOR):
        if not _number(value) or not value > 0 or math.isinf(value):
            raise _bad(name, kind, value)
        return float(value)
    if kind is Kind.SECTIONS:
        return _sections(name, value)
    if kind is Kind.SIGNAL:
        if value is None or isinstance(value, bool):
            raise _bad(name, kind, value)
        try:
            return parse_signal(value)
        except ValueError:
            raise _bad(name, kind, value) from None
    if kind is Kind.LOG_LEVEL:
        if isinstance(value, str) and value.strip().upper() in _LOG_LEVELS:
            return _LOG_LEVELS[value.strip().upper()]
        number = isinstance(value, int) and not isinstance(value, bool)
        if number and logging.DEBUG <= value <= logging.CRITICAL:
            return value
        raise _bad(name, kind, value)
    if kind is Kind.FLAG:
        if not isinstance(value, bool):
            raise _bad(name, kind, value)
        return value
    if value is not None and not isinstance(value, str):
        raise _bad(name, kind, value)
    return value


def _sections(name: str, value: Any) -> dict[str, float | None]:
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{name} must map section names to None or seconds > 0, got {shown(value)}"
        )
    if len(value) > layout.MAX_SECTIONS:
        raise ValueError(
            f"{name} names {len(value)} sections; a rank tracks at most {layout.MAX_SECTIONS}"
        )
    out: dict[str, float | None] = {}
    for section, secs in value.items():
        if not isinstance(section, str) or not section:
            raise ValueError(
                f"{name}: section names must be non-empty strings, got {shown(section)}"
            )
        if len(section.encode("utf-8", errors="replace")) > layout.NAME_BYTES:
            raise ValueError(
                f"{name}: section name {section[:60]!r} is longer than "
                f"{layout.NAME_BYTES} UTF-8 bytes"
            )
        out[section] = check(f"{name}[{section!r}]", Kind.TIMEOUT, secs)
    return out


def _seconds(name: str, value: Any) -> float | None:
    """A timeout as the monitor uses it: None (or infinity) means not checked."""
    secs = check(name, Kind.TIMEOUT, value)
    return None if secs is None or math.isinf(secs) else float(secs)


@dataclasses.dataclass
class FaultToleranceConfig:
    """NVIDIA's fault-tolerance settings, with its names, order and defaults. A timeout
    of None is not checked; `rank_section_timeouts` maps a section name to seconds or
    None. Values are checked and normalised when the record is built (a signal given by
    name or number becomes a `signal.Signals`, a log level name its number); a field
    assigned later is checked again when the record is used or written."""

    workload_check_interval: float = field(default=5.0, metadata=_meta(Kind.SECONDS, True))
    initial_rank_heartbeat_timeout: float | None = field(
        default=60.0 * 60.0, metadata=_meta(Kind.TIMEOUT, True)
    )
    rank_heartbeat_timeout: float | None = field(
        default=45.0 * 60.0, metadata=_meta(Kind.TIMEOUT, True)
    )
    rank_section_timeouts: Mapping[str, float | None] = field(
        default_factory=dict, metadata=_meta(Kind.SECTIONS, True)
    )
    rank_out_of_section_timeout: float | None = field(
        default=None, metadata=_meta(Kind.TIMEOUT, True)
    )
    node_health_check_interval: float = field(default=5.0, metadata=_meta(Kind.SECONDS, False))
    # Under RankMonitorServer a rank learns its timeouts with this factor, as NVIDIA's
    # client does with the config its server sends it.
    safety_factor: float = field(default=5.0, metadata=_meta(Kind.FACTOR, True))
    rank_termination_signal: signal.Signals | int | str = field(
        default=signal.SIGKILL, metadata=_meta(Kind.SIGNAL, True)
    )
    log_level: int | str = field(default=logging.INFO, metadata=_meta(Kind.LOG_LEVEL, False))
    restart_check_interval: float = field(default=60.0, metadata=_meta(Kind.SECONDS, False))
    enable_nic_monitor: bool = field(default=True, metadata=_meta(Kind.FLAG, False))
    pci_topo_file: str | None = field(default=None, metadata=_meta(Kind.TEXT, False))
    link_down_path_template: str | None = field(default=None, metadata=_meta(Kind.TEXT, False))

    def __post_init__(self) -> None:
        self._normalise()

    def _normalise(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, check(f.name, f.metadata["kind"], getattr(self, f.name)))

    @staticmethod
    def from_kwargs(ignore_not_recognized: bool = True, **kwargs: Any) -> FaultToleranceConfig:
        """The defaults with `kwargs` applied. A key that names no field is ignored
        (with a warning naming it) or, with `ignore_not_recognized=False`, refused."""
        return _build(kwargs, ignore_not_recognized)

    @staticmethod
    def from_yaml_file(
        cfg_path: str | os.PathLike[str], ignore_not_recognized: bool = True
    ) -> FaultToleranceConfig:
        """The settings in the file's `fault_tolerance:` section, at the top level or
        nested in other mappings or lists (the first non-empty one found). The file is
        read with YAML's safe loader (no Python tags), bounded as `stalwart.base.yamlfile` says."""
        data = read_yaml(Path(cfg_path))
        section = find_section(data)
        if section is None:
            raise SectionMissing(f"{cfg_path}: no non-empty '{SECTION}:' section in the file")
        if not isinstance(section, dict):
            raise ValueError(
                f"{cfg_path}: '{SECTION}:' must be a mapping of settings, "
                f"got {type(section).__name__}"
            )
        try:
            return _build(section, ignore_not_recognized)
        except ValueError as err:
            raise ValueError(f"{cfg_path}: {SECTION}: {err}") from None

    @staticmethod
    def from_args(args: argparse.Namespace) -> FaultToleranceConfig:
        """The defaults, then the `--ft-cfg-path` file's section, then each `--ft-*`
        option given (as `add_arguments` declares them)."""
        given = vars(args)
        if not any(k.startswith(OPTION_PREFIX + "_") for k in given):
            raise ValueError(
                "FaultToleranceConfig.from_args: the namespace has no ft_* attributes "
                "(parse with the --ft-* options: stalwart.monitor.ft_config.add_arguments)"
            )
        base: dict[str, Any] = {}
        path = given.get(f"{OPTION_PREFIX}_cfg_path")
        if path is not None:
            try:
                base = dataclasses.asdict(FaultToleranceConfig.from_yaml_file(path))
            except FileNotFoundError:
                raise ValueError(f"--ft-cfg-path {path}: no such file") from None
            except SectionMissing as err:
                # As NVIDIA's launcher: a training config without the section leaves
                # the defaults and the options. Anything else wrong is an error.
                log.info("%s", err)
        return FaultToleranceConfig(**merge_options(base, given))

    def to_yaml_file(self, cfg_path: str | os.PathLike[str]) -> None:
        """Writes the settings as a `fault_tolerance:` section that `from_yaml_file`
        reads back equal. The file appears whole or not at all."""
        import yaml

        self._normalise()
        text = yaml.safe_dump({SECTION: self.as_plain()}, sort_keys=False)
        path = Path(cfg_path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def as_plain(self) -> dict[str, Any]:
        """The settings as plain YAML/JSON values (the signal by name)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, signal.Signals):
                value = value.name
            elif isinstance(value, Mapping):
                value = dict(value)
            out[f.name] = value
        return out

    def configured(self) -> Configured:
        """The timeouts a rank reports in force before it learns any."""
        sections = {
            name: _seconds(f"rank_section_timeouts[{name!r}]", secs)
            for name, secs in _sections("rank_section_timeouts", self.rank_section_timeouts).items()
        }
        return Configured(
            _seconds("initial_rank_heartbeat_timeout", self.initial_rank_heartbeat_timeout),
            _seconds("rank_heartbeat_timeout", self.rank_heartbeat_timeout),
            sections,
            _seconds("rank_out_of_section_timeout", self.rank_out_of_section_timeout),
        )

    def monitor_config(self) -> MonitorConfig:
        """The same settings as stalwart's judge reads them."""
        interval = check("workload_check_interval", Kind.SECONDS, self.workload_check_interval)
        term = check("rank_termination_signal", Kind.SIGNAL, self.rank_termination_signal)
        return judged(self.configured(), interval, term)


def judged(conf: Configured, interval: float, term_signal: signal.Signals) -> MonitorConfig:
    """The judge's settings for configured timeouts, a check interval and a signal."""
    initial = conf.hb_initial
    if initial is not None and conf.hb is not None:
        # stalwart never lets the first heartbeat have less time than later ones.
        initial = max(initial, conf.hb)
    return MonitorConfig(
        hb_timeout=conf.hb,
        hb_initial_timeout=initial,
        section_timeouts={k: v for k, v in conf.sections.items() if v is not None},
        out_of_section_timeout=conf.oos,
        check_interval=interval,
        term_signal=term_signal,
    )


def _names() -> str:
    return ", ".join(f.name for f in dataclasses.fields(FaultToleranceConfig))


def not_acted_on() -> list[str]:
    """The fields stalwart keeps but does not act on."""
    return [f.name for f in dataclasses.fields(FaultToleranceConfig) if not f.metadata["acted_on"]]


def split_known(settings: Mapping[Any, Any]) -> tuple[dict[str, Any], list[str]]:
    """The settings that name a field, and the names of those that do not."""
    fields = {f.name for f in dataclasses.fields(FaultToleranceConfig)}
    known = {k: v for k, v in settings.items() if k in fields}
    return known, [repr(k) if not isinstance(k, str) else k for k in settings if k not in fields]


def _build(settings: Mapping[Any, Any], ignore_not_recognized: bool) -> FaultToleranceConfig:
    known, unknown = split_known(settings)
    if unknown:
        shown = ", ".join(name[:60] for name in sorted(unknown)[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        what = f"not recognized: {shown}{more} (expected some of {_names()})"
        if not ignore_not_recognized:
            raise ValueError(f"FaultToleranceConfig: {what}")
        log.warning("FaultToleranceConfig: ignoring settings %s", what)
    return FaultToleranceConfig(**known)


def find_section(data: Any) -> Any:
    """The first non-empty `fault_tolerance` value in `data`, depth first in document
    order: a mapping that has the key answers for itself, others are searched. Each
    container is visited once, so YAML aliases (shared or self-referencing nodes)
    cannot make the search explode or loop."""
    seen: set[int] = set()
    stack: list[Any] = [data]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict | list) or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, dict) and SECTION in node:
            if node[SECTION]:
                return node[SECTION]
            continue
        children = list(node.values()) if isinstance(node, dict) else list(node)
        stack.extend(reversed(children))
    return None


def parse_section_timeouts(text: str) -> dict[str, float | None]:
    """`name:seconds,name:seconds` (seconds `none`, `null` or empty: not checked)."""
    out: dict[str, float | None] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        name, sep, secs = item.partition(":")
        if not sep or ":" in secs or not name.strip():
            raise ValueError(
                f"rank_section_timeouts: expected name:seconds[,name:seconds...], got {shown(item)}"
            )
        secs = secs.strip()
        if secs.lower() in ("none", "null", ""):
            out[name.strip()] = None
            continue
        try:
            out[name.strip()] = float(secs)
        except ValueError:
            raise ValueError(
                f"rank_section_timeouts: {shown(name.strip())} must be seconds or none, got {shown(secs)}"
            ) from None
    return out


def merge_options(base: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """`base` settings overlaid with the `ft_<field>` options that were given (not
    None), the section timeouts parsed from their `name:seconds,...` text."""
    out = dict(base)
    for f in dataclasses.fields(FaultToleranceConfig):
        value = given.get(f"{OPTION_PREFIX}_{f.name}")
        if value is None:
            continue
        if f.metadata["kind"] is Kind.SECTIONS and isinstance(value, str):
            value = parse_section_timeouts(value)
        out[f.name] = value
    return out


def _flag_value(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ValueError(text)


def _option_type(kind: Kind) -> Any:
    if kind in (Kind.TIMEOUT, Kind.SECONDS, Kind.FACTOR):
        return float
    if kind is Kind.FLAG:
        return _flag_value
    return str


def option_spellings(name: str) -> Iterator[str]:
    """`--ft-rank-heartbeat-timeout` and `--ft-rank_heartbeat_timeout`, as NVIDIA's."""
    yield f"--{OPTION_PREFIX}-{name.replace('_', '-')}"
    if "_" in name:
        yield f"--{OPTION_PREFIX}-{name}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `--ft-cfg-path` and one `--ft-<field>` option per field (both of NVIDIA's
    spellings), each defaulting to None: not given, so the file's value or the
    default stands. `FaultToleranceConfig.from_args` reads them."""
    group = parser.add_argument_group("NVIDIA fault tolerance (FaultToleranceConfig)")
    group.add_argument(
        *option_spellings("cfg_path"),
        dest=f"{OPTION_PREFIX}_cfg_path",
        default=None,
        metavar="FILE",
        help=f"YAML file with a '{SECTION}:' section; the --ft-* options below override it",
    )
    for f in dataclasses.fields(FaultToleranceConfig):
        kind: Kind = f.metadata["kind"]
        note = "" if f.metadata["acted_on"] else "; kept, not acted on by stalwart"
        fmt = "name:seconds,..." if kind is Kind.SECTIONS else kind.value
        group.add_argument(
            *option_spellings(f.name),
            dest=f"{OPTION_PREFIX}_{f.name}",
            type=_option_type(kind),
            default=None,
            metavar=f.name.upper(),
            help=f"FaultToleranceConfig.{f.name}: {fmt}{note}",
        )
