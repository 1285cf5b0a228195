"""The launcher's settings: the layer under the launcher, importing nothing of it.

Its one import of another package is `hang`'s: it builds the monitor's own typed record
(`MonitorConfig`) from text, so the monitor is handed checked values and parses nothing.

Every setting is declared once (`settings.LaunchConfig`: a field and its `Flag`); the
command-line parser, the ``STALWART_*`` variables, the YAML keys and the precedence
between them are derived from those declarations (`layers`).  Values are parsed and
checked here, once: downstream code gets typed values (`Std`, `Endpoint`,
`RendezvousConf`), never text to parse again.
"""

from stalwart.config.endpoints import Endpoint, parse_endpoint, parse_endpoints
from stalwart.config.flags import HANG_FLAGS, Flag
from stalwart.config.host import check_log_dir, max_local_workers
from stalwart.config.layers import launch_flags
from stalwart.config.output import (
    DEFAULT_PREFIX,
    Std,
    parse_ranks_filter,
    parse_std,
)
from stalwart.config.rdzv import EtcdAccessConf, RendezvousConf, etcd_access
from stalwart.config.settings import (
    RDZV_BACKENDS,
    RESTART_POLICIES,
    LaunchConfig,
)
from stalwart.config.values import (
    ConfigError,
    parse_kv,
    parse_nnodes,
    parse_nproc,
    parse_size,
)

__all__ = [
    "DEFAULT_PREFIX",
    "HANG_FLAGS",
    "RDZV_BACKENDS",
    "RESTART_POLICIES",
    "ConfigError",
    "Endpoint",
    "EtcdAccessConf",
    "Flag",
    "LaunchConfig",
    "RendezvousConf",
    "Std",
    "check_log_dir",
    "etcd_access",
    "launch_flags",
    "max_local_workers",
    "parse_endpoint",
    "parse_endpoints",
    "parse_kv",
    "parse_nnodes",
    "parse_nproc",
    "parse_ranks_filter",
    "parse_size",
    "parse_std",
]
