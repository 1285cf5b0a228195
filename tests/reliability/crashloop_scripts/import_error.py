# A script whose import fails in every attempt (a module that is not installed).
import os

if os.environ["RANK"] == "0":
    import stalwart_no_such_module  # noqa: F401
