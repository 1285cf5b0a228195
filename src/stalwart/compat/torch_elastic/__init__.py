"""``torch.distributed.elastic``'s module layout over stalwart: replace the prefix
``torch.distributed.elastic`` with ``stalwart.compat.torch_elastic`` in an import line.

Each module here only names what lives elsewhere (``stalwart.monitor.file_timer``,
``stalwart.launch.workers.torch_errors``); importing the timer loads nothing of the
launcher. Where stalwart differs on purpose, docs/migrating.md says why.
"""
