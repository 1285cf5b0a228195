"""Work a framework leaves for its first call, done once in the warm template.

Some libraries build a table the first time a function needs it and keep it in a module
global.  A worker forked from a template where that table exists inherits it; one forked
before pays for it again, in the training loop, after every restart.  The case that
made this module: transformers 5 builds its checkpoint conversion mapping (about a
thousand regular expressions compiled) on the first ``save_pretrained`` of a process,
so a restarted HF ``Trainer`` worker's first checkpoint save took 1.6-1.8 s instead of
0.12-0.2 s at a load of 15 (0.4 s alone on the same machine), and the job was not back
at full speed until that save was behind it.

Each entry names a module, a function of it, and its arguments: called only when the
template already holds the module (preloaded or learned from the job's workers), never
to import anything, and only when the call's effect is a cache the same library would
fill in the worker with the same content (what the worker then computes does not
change).  A call that fails is dropped with its reason; the template checks after the
calls, as after its imports, that it may still fork (one thread, no CUDA).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Prewarm:
    module: str
    function: str
    args: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.module}.{self.function}"


PREWARMS: tuple[Prewarm, ...] = (
    # Builds _checkpoint_conversion_mapping_cache for every model type at once; the
    # argument only picks which entry the call returns (a copy, discarded).
    Prewarm("transformers.conversion_mapping", "get_checkpoint_conversion_mapping", ("gpt2",)),
)


def due(imported: Iterable[str], table: Iterable[Prewarm] = PREWARMS) -> list[Prewarm]:
    """The entries of *table* whose module is among *imported*, in table order."""
    have = set(imported)
    return [p for p in table if p.module in have]


def run(
    prewarms: Iterable[Prewarm], modules: Mapping[str, ModuleType]
) -> tuple[list[str], list[str]]:
    """Calls each prewarm on the module found in *modules* (``sys.modules``): (names of
    those that ran, those dropped with the reason).  Whatever a module does, nothing is
    raised: a prewarm must never keep a template from serving."""
    done: list[str] = []
    dropped: list[str] = []
    for p in prewarms:
        mod = modules.get(p.module)
        fn = getattr(mod, p.function, None) if mod is not None else None
        if not callable(fn):
            dropped.append(f"{p.name} (not a function of the imported module)")
            continue
        try:
            fn(*p.args)
        except BaseException as exc:  # the library's own failure: it stays lazy
            dropped.append(f"{p.name} ({type(exc).__name__}: {exc})"[:500])
            continue
        done.append(p.name)
    return done, dropped
