"""``torch.distributed.elastic.multiprocessing``: its error records, for now (torch's
process contexts, ``start_processes`` with ``logs_specs``, are not spelled here yet:
stalwart's own are ``stalwart.launch.workers.processes``)."""

from stalwart.launch.workers.torch_errors import ProcessFailure, record

__all__ = ["ProcessFailure", "record"]
