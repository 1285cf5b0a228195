"""The bottom layer: process primitives and liveness shared by every other package.

It imports nothing else of stalwart, and only the standard library at import time, so
that ``monitor``, ``inprocess`` and ``checkpoint`` (which run inside workers, also under
plain torchrun) and the launcher can all stand on it.
"""
