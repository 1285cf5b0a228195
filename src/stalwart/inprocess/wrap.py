"""``Wrapper`` under NVIDIA ``inprocess``'s module path (``inprocess.wrap.Wrapper``);
defined in ``wrapper``."""

from .wrapper import Wrapper

__all__ = ["Wrapper"]
