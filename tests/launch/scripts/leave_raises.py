"""Runs ``stalwart run ARGS`` in this process with a rendezvous whose ``leave()`` raises,
then prints (JSON) what the launcher's teardown left behind."""

from __future__ import annotations

import json
import signal
import sys
from typing import Any

import psutil

from stalwart.cli import build_config
from stalwart.launch.round.membership import rendezvous_for
from stalwart.launch.round.supervisor import Supervisor


class LeaveRaises:
    """A real rendezvous, but leaving it fails (as when its store is gone)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def leave(self) -> None:
        self.inner.leave()
        raise RuntimeError("leave failed")


def main() -> None:
    cfg, _ = build_config(sys.argv[1:])
    before = signal.getsignal(signal.SIGTERM)
    sup = Supervisor(cfg, rendezvous=LeaveRaises(rendezvous_for(cfg)))  # type: ignore[arg-type]
    error = ""
    try:
        sup.run()
    except RuntimeError as err:
        error = str(err)
    children = psutil.Process().children(recursive=True)
    print(
        json.dumps(
            {
                "error": error,
                "children": [c.pid for c in children if c.status() != psutil.STATUS_ZOMBIE],
                "handler_restored": signal.getsignal(signal.SIGTERM) == before,
            }
        )
    )


if __name__ == "__main__":
    main()
