"""Hang-detection settings: the typed `MonitorConfig` record and its invariants.

Text (flags, YAML, environment) is parsed once, in `stalwart.config.hang`, which builds
this record; the monitor receives it typed and checked.  The checks below hold for a
record built in code as well (the NVIDIA-compatible client, tests).
"""

from __future__ import annotations

import dataclasses
import math
import signal
from collections.abc import Mapping
from typing import Any

#: Used for the first heartbeat when only `hb_timeout` is given: the first step usually
#: includes process-group setup and model construction, which is far slower than a step.
DEFAULT_MIN_INITIAL_TIMEOUT = 60.0


#: What a learned timeout is before warm-up where kills need evidence (monitor.evidence).
EVIDENCE_PREWARM_TIMEOUT = 5.0
#: Warm-up (steps) of the hang detection a job gets with no timeout configured.
RHYTHM_WARMUP_STEPS = 20
_DEFAULT_WARMUP_STEPS = 100


def _positive(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    if math.isnan(value) or value <= 0:
        raise ValueError(f"{name} must be > 0 seconds, got {value!r}")


def _positive_number(name: str, value: float) -> None:
    """Like `_positive` for settings that are plain numbers (factors, percentiles)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if math.isnan(value) or value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def parse_signal(value: str | int | signal.Signals) -> signal.Signals:
    """Accepts ``SIGTERM``, ``TERM``, ``15`` or a `signal.Signals`."""
    if isinstance(value, signal.Signals):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return signal.Signals(value)
        except ValueError:
            raise ValueError(f"term_signal: unknown signal number {value!r}") from None
    if isinstance(value, str):
        text = value.strip().upper()
        if text.isdigit():
            return parse_signal(int(text))
        if not text.startswith("SIG"):
            text = "SIG" + text
        try:
            return signal.Signals[text]
        except KeyError:
            pass
    raise ValueError(f"term_signal: unknown signal {value!r}")


@dataclasses.dataclass(frozen=True)
class MonitorConfig:
    """How a node's monitor judges its ranks. A timeout of None means "not checked".

    hb_timeout: longest allowed gap between two heartbeats of a rank.
    hb_initial_timeout: longest allowed time from client start to the first heartbeat;
        when None it is max(hb_timeout, 60 s).
    section_timeouts: longest time each named section may stay open.
    out_of_section_timeout: longest time a rank may spend with no section open.
    safety_factor: learned timeouts are the largest observed interval times this.
    check_interval: how often the scanner looks at the ranks' slots.
    stack_dump_wait: how long to let a hung rank write its stacks before terminating it.
    term_signal: signal that terminates a hung rank; SIGKILL follows after term_grace.
    hb_auto, section_auto, oos_auto: learn the heartbeat / section / out-of-section
        timeouts from the rhythm the node monitor observes (``auto`` in place of a number;
        see monitor.auto). A number given for a section still wins for that section.
    auto_warmup_steps, auto_warmup_seconds: a rank's learned timeouts apply once the
        monitor saw this many of its heartbeats and this much time in the attempt.
    auto_percentile: which observed interval counts (100 = the longest).
    auto_floor: learned timeouts are never shorter than this.
    straggler_factor: a rank whose seconds per step are this many times the median of
        the node's other ranks over a window is reported as a straggler (information).
    straggler_window: seconds of progress each straggler verdict looks at.
    straggler_restart: a straggler's node leaves the job and the others restart without
        it (elastic membership only); otherwise stragglers are information only.
    auto_progress: workers count each optimizer step as a training step
        (`stalwart.autostep`); False leaves steps to the program's own reports.
    evidence: a missed deadline is only a suspicion until the rank's processes show it
        hung (stopped, or asleep in a wait without using the CPU; see monitor.evidence).
        None: only where no timeout is a number (learned deadlines need evidence, the
        user's numbers act as given).
    """

    hb_timeout: float | None = None
    hb_initial_timeout: float | None = None
    section_timeouts: Mapping[str, float] = dataclasses.field(default_factory=dict)
    out_of_section_timeout: float | None = None
    safety_factor: float = 5.0
    check_interval: float = 0.1
    stack_dump_wait: float = 0.2
    term_signal: signal.Signals = signal.SIGTERM
    term_grace: float = 3.0
    hb_auto: bool = False
    section_auto: bool = False
    oos_auto: bool = False
    auto_warmup_steps: int = _DEFAULT_WARMUP_STEPS
    auto_warmup_seconds: float = 0.0
    auto_percentile: float = 100.0
    auto_floor: float = 0.5
    straggler_factor: float = 2.0
    straggler_window: float = 30.0
    straggler_restart: bool = False
    auto_progress: bool = True
    evidence: bool | None = None

    def __post_init__(self) -> None:
        if isinstance(self.auto_warmup_steps, bool) or not isinstance(self.auto_warmup_steps, int):
            raise ValueError(
                f"auto_warmup_steps must be a whole number, got {self.auto_warmup_steps!r}"
            )
        if self.auto_warmup_steps < 1:
            raise ValueError(f"auto_warmup_steps must be >= 1, got {self.auto_warmup_steps!r}")
        if not isinstance(self.auto_warmup_seconds, int | float) or not (
            self.auto_warmup_seconds >= 0
        ):
            raise ValueError(
                f"auto_warmup_seconds must be >= 0 seconds, got {self.auto_warmup_seconds!r}"
            )
        _positive_number("auto_percentile", self.auto_percentile)
        if self.auto_percentile > 100:
            raise ValueError(f"auto_percentile must be in (0, 100], got {self.auto_percentile!r}")
        if self.evidence is not None and not isinstance(self.evidence, bool):
            raise ValueError(f"evidence must be true or false, got {self.evidence!r}")
        _positive("auto_floor", self.auto_floor)
        _positive("straggler_window", self.straggler_window)
        _positive_number("straggler_factor", self.straggler_factor)
        if self.straggler_factor <= 1:
            raise ValueError(f"straggler_factor must be > 1, got {self.straggler_factor!r}")
        _positive("hb_timeout", self.hb_timeout)
        _positive("hb_initial_timeout", self.hb_initial_timeout)
        _positive("out_of_section_timeout", self.out_of_section_timeout)
        _positive("check_interval", self.check_interval)
        _positive("term_grace", self.term_grace)
        if isinstance(self.stack_dump_wait, bool) or not isinstance(
            self.stack_dump_wait, int | float
        ):
            raise ValueError(
                f"stack_dump_wait must be a number of seconds, got {self.stack_dump_wait!r}"
            )
        if math.isnan(self.stack_dump_wait) or self.stack_dump_wait < 0:
            raise ValueError(f"stack_dump_wait must be >= 0 seconds, got {self.stack_dump_wait!r}")
        _positive_number("safety_factor", self.safety_factor)
        if self.safety_factor < 1:
            raise ValueError(f"safety_factor must be >= 1, got {self.safety_factor!r}")
        if (
            self.hb_timeout is not None
            and self.hb_initial_timeout is not None
            and self.hb_initial_timeout < self.hb_timeout
        ):
            raise ValueError(
                f"hb_initial_timeout ({self.hb_initial_timeout}) must not be shorter than "
                f"hb_timeout ({self.hb_timeout})"
            )
        for name, secs in self.section_timeouts.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"section timeout names must be non-empty strings, got {name!r}")
            _positive(f"section timeout {name!r}", secs)
        # The scanner must never see a hung rank get its own signal number wrong.
        object.__setattr__(self, "term_signal", parse_signal(self.term_signal))
        object.__setattr__(self, "section_timeouts", dict(self.section_timeouts))

    @property
    def effective_initial_timeout(self) -> float | None:
        """The initial heartbeat timeout actually enforced."""
        if self.hb_initial_timeout is not None:
            return self.hb_initial_timeout
        if self.hb_timeout is None:
            return DEFAULT_MIN_INITIAL_TIMEOUT if self.hb_auto else None
        return max(self.hb_timeout, DEFAULT_MIN_INITIAL_TIMEOUT)

    @property
    def auto_initial_timeout(self) -> float:
        """What a learned (``auto``) timeout is before the rank warmed up."""
        if self.hb_initial_timeout is not None:
            return self.hb_initial_timeout
        if self.needs_evidence:
            # A missed deadline only starts the evidence cycle: no need to wait long.
            return EVIDENCE_PREWARM_TIMEOUT
        return DEFAULT_MIN_INITIAL_TIMEOUT

    @property
    def any_number(self) -> bool:
        """A timeout given as a number of seconds."""
        return (
            self.hb_timeout is not None
            or self.hb_initial_timeout is not None
            or self.out_of_section_timeout is not None
            or bool(self.section_timeouts)
        )

    @property
    def needs_evidence(self) -> bool:
        return self.evidence if self.evidence is not None else not self.any_number

    def defaulted(self) -> MonitorConfig:
        """What the launcher runs when the user configured no timeout at all: the heartbeat
        timeout learned from the steps stalwart sees (`stalwart.autostep`), warm after
        `RHYTHM_WARMUP_STEPS` (unless the user set a warm-up), kills on evidence only."""
        if self.any_number or self.any_auto or not self.auto_progress:
            return self
        steps = self.auto_warmup_steps
        if steps == _DEFAULT_WARMUP_STEPS:
            steps = RHYTHM_WARMUP_STEPS
        return dataclasses.replace(self, hb_auto=True, auto_warmup_steps=steps)

    @property
    def any_auto(self) -> bool:
        return self.hb_auto or self.section_auto or self.oos_auto

    @property
    def enabled(self) -> bool:
        """True when at least one heartbeat or section timeout is configured."""
        return (
            self.hb_timeout is not None
            or self.hb_initial_timeout is not None
            or self.out_of_section_timeout is not None
            or bool(self.section_timeouts)
            or self.any_auto
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (JSON-safe), e.g. for events."""
        out = dataclasses.asdict(self)
        out["term_signal"] = self.term_signal.name
        out["section_timeouts"] = dict(self.section_timeouts)
        return out


def __getattr__(name: str) -> Any:
    # NVIDIA's `fault_tolerance.config.FaultToleranceConfig`, whose import path maps
    # here; loaded on first use because ft_config itself builds on this module.
    if name == "FaultToleranceConfig":
        from stalwart.monitor.ft_config import FaultToleranceConfig

        return FaultToleranceConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
