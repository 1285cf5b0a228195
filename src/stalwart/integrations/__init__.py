"""Thin adapters that give framework jobs hang detection and goodput accounting.

``stalwart.integrations.lightning.StalwartCallback`` (Lightning) and
``stalwart.integrations.transformers.StalwartTrainerCallback`` (HF ``Trainer``) each
heartbeat the hang monitor, report the step and record the framework's checkpoint
saves, with one line of user code.  The frameworks stay optional: nothing here imports
one until its adapter is used, and both names can be imported from this package.
"""

from __future__ import annotations

from typing import Any

from stalwart.integrations._core import Reporter

__all__ = ["Reporter", "StalwartCallback", "StalwartTrainerCallback"]


def __getattr__(name: str) -> Any:
    if name == "StalwartCallback":
        from stalwart.integrations.lightning import StalwartCallback

        return StalwartCallback
    if name == "StalwartTrainerCallback":
        from stalwart.integrations.transformers import StalwartTrainerCallback

        return StalwartTrainerCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
