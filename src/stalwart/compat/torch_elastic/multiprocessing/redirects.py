"""``torch.distributed.elastic.multiprocessing.redirects`` (see
``stalwart.launch.files.redirects``)."""

from stalwart.launch.files.redirects import redirect, redirect_stderr, redirect_stdout

__all__ = ["redirect", "redirect_stderr", "redirect_stdout"]
