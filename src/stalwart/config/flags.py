"""How a launcher setting is declared: the `Flag` record and its parsers and checks.

A `Flag` carries all of a setting's spellings (command-line names, the ``STALWART_<KEY>``
variable, the YAML key), its help, its parser and its check; ``settings.LaunchConfig``
declares each field with one, and ``config.layers`` derives the argparse parser and the
precedence merge from them.  Hang detection's flags (`HANG_FLAGS`) are declared here as a
group of their own: their values make the monitor's ``MonitorConfig``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Any

from stalwart.config.values import ConfigError, is_false

ENV_PREFIX = "STALWART_"

Parse = Callable[[Any, str], Any]
Check = Callable[[Any], str]


@dataclass(frozen=True)
class Flag:
    """How one setting is spelled on the command line, in the environment and in YAML."""

    names: tuple[str, ...]  # as torchrun spells them; "--a-b" also gets "--a_b"
    key: str  # the YAML key, the environment's suffix and argparse's dest
    help: str | None = None
    parse: Parse | None = None  # (value, flag name) -> typed value; None: str()
    argtype: Callable[[str], Any] | None = None  # argparse's own check (int, float, Path)
    action: str | None = None  # store_true, store_const, append; None: takes a value
    const: Any = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    nargs: str | None = None
    env: str | None = None  # the environment variable; None: none
    yaml: bool = True  # read from the --config file's top level
    torch_env: str | None = None  # torchrun's own variable (an empty value is unset)
    target: str = ""  # the LaunchConfig field or MonitorConfig key it sets ("": key)
    check: Check | None = None  # the typed value -> "" when good, else what was expected

    @property
    def spellings(self) -> tuple[str, ...]:
        out: list[str] = []
        for name in self.names:
            out.append(name)
            if name.startswith("--") and "-" in name[2:]:
                out.append("--" + name[2:].replace("-", "_"))  # torchrun's other spelling
        return tuple(out)

    @property
    def flag(self) -> str:
        """The spelling errors name: the first long one."""
        return next((n for n in self.names if n.startswith("--")), self.names[0])

    @property
    def positional(self) -> bool:
        return not self.names[0].startswith("-")

    @property
    def sets(self) -> str:
        """The name of what it sets (a LaunchConfig field, a MonitorConfig key)."""
        return self.target or self.key

    def value(self, raw: Any) -> Any:
        """*raw* (text, or a YAML scalar or list) as the setting's type."""
        if self.parse is None:
            return str(raw)
        return self.parse(raw, self.flag)

    def problem(self, value: Any) -> str:
        """One line naming a bad typed *value* and what was expected ("" when good)."""
        why = self.check(value) if self.check is not None else ""
        if not why:
            return ""
        shown = repr(value) if isinstance(value, str) else str(value)
        return f"{self.flag} {shown}: {why}"


def flag(
    *names: str,
    key: str = "",
    env: bool = True,
    yaml: bool = True,
    **kw: Any,
) -> Flag:
    """A `Flag`; its key is the first long name's (``--max-restarts``: ``max_restarts``),
    its variable ``STALWART_<KEY>`` unless *env* is False."""
    long = next((n for n in names if n.startswith("--")), names[0])
    key = key or long.lstrip("-").replace("-", "_")
    return Flag(
        names=names, key=key, env=ENV_PREFIX + key.upper() if env else None, yaml=yaml, **kw
    )


def setting(default: Any = MISSING, f: Flag | None = None, *, factory: Any = MISSING) -> Any:
    """A `LaunchConfig` field: its default and its `Flag`."""
    meta = {"flag": f} if f is not None else {}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def checked(ok: Callable[[Any], bool], expected: str) -> Check:
    def check(value: Any) -> str:
        return "" if ok(value) else expected

    return check


def one_of(choices: tuple[str, ...]) -> Check:
    return checked(lambda v: v in choices, f"expected one of {', '.join(choices)}")


def typed(conv: Callable[[Any], Any]) -> Parse:
    def parse(value: Any, name: str) -> Any:
        try:
            return conv(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} {value!r}: expected {conv.__name__}") from None

    return parse


def one_line(parse: Callable[[str, str], Any]) -> Parse:
    def wrapped(value: Any, name: str) -> Any:
        try:
            return parse(str(value), name)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    return wrapped


def as_switch(value: Any, _name: str) -> bool:
    # A flag or YAML gives a bool; torchrun's PET_<FLAG> variables give "1" or "0".
    return value if isinstance(value, bool) else not is_false(value)


def as_given(value: Any, _name: str) -> Any:
    return value


INT, FLOAT = typed(int), typed(float)
# A number flag: argparse checks the command line, the parser YAML and variables.
AN_INT: dict[str, Any] = {"argtype": int, "parse": INT}
A_FLOAT: dict[str, Any] = {"argtype": float, "parse": FLOAT}
HANG_GROUP = "hang detection (see docs/monitor.md)"


def switch_flag(*names: str, help: str | None = None) -> Flag:
    """A switch of the command line (no STALWART_ variable, no YAML key), as torchrun's;
    its PET_<FLAG> variable is read by ``stalwart.cluster``."""
    return flag(*names, env=False, yaml=False, action="store_true", parse=as_switch, help=help)


def filters_flag(stream: str) -> Flag:
    """torchrun's ``--duplicate-<stream>-filters``: its default (no filter) only."""
    return flag(
        f"--duplicate-{stream}-filters",
        parse=torch_list,
        help="not supported; refused unless empty",
        check=checked(
            lambda s: not s,
            f"not supported by stalwart run; grep attempt_<n>/<rank>/{stream}.log instead",
        ),
    )


def torch_list(value: Any, _name: str) -> list[str]:
    """torchrun's comma-separated list, ``,,`` standing for a comma (or a YAML list)."""
    if isinstance(value, list):
        return [str(v) for v in value]
    parts = str(value).replace(",,", "\0").split(",")
    return [p.replace("\0", ",") for p in parts if p]


def hang_flag(*names: str, **kw: Any) -> Flag:
    # Values stay as given: config.hang parses (and names) them, once.
    return flag(*names, yaml=False, parse=as_given, **kw)


# The monitor's settings are YAML's ``monitor:`` mapping, keyed by MonitorConfig's names.
HANG_FLAGS: tuple[Flag, ...] = (
    hang_flag("--hb-timeout", help="max seconds between heartbeats, or auto"),
    hang_flag("--hb-initial-timeout", help="max seconds to the first heartbeat"),
    hang_flag(
        "--section-timeout",
        target="section_timeouts",
        action="append",
        metavar="NAME=SECS",
        help="max seconds a named section may stay open (repeatable); auto learns the others",
    ),
    hang_flag("--out-of-section-timeout", help="max seconds with no section open, or auto"),
    hang_flag("--safety-factor", help="learned timeout = max observed x this"),
    hang_flag(
        "--hang-signal", target="term_signal", help="signal sent to a hung rank (default TERM)"
    ),
    hang_flag("--stack-dump-wait", help="seconds to let a hung rank dump stacks"),
    hang_flag("--auto-warmup-steps", help="heartbeats seen before auto applies"),
    hang_flag("--auto-warmup-seconds", help="seconds seen before auto applies"),
    hang_flag("--auto-percentile", help="observed interval auto uses (100=max)"),
    hang_flag("--auto-floor", help="shortest timeout auto may learn (seconds)"),
    hang_flag("--straggler-factor", help="slower than the others by this: named"),
    hang_flag("--straggler-window", help="seconds each straggler verdict spans"),
    hang_flag(
        "--straggler-restart",
        action="store_const",
        const=True,
        help="restart the job without a straggler's node (elastic --nnodes MIN:MAX)",
    ),
    hang_flag(
        "--no-auto-progress",
        target="auto_progress",
        env=False,  # YAML's monitor.auto_progress; a STALWART_NO_... variable would read backwards
        action="store_const",
        const=False,
        help="do not count optimizer steps as training steps (program reports its own)",
    ),
)
