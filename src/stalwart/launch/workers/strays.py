"""The stray-process scan of a worker group: what its workers started that a group kill
would miss, and killing it at teardown.

Three nets, because each misses something the others catch: the job's cgroup (everything,
where cgroup v2 is usable), what the launcher sees as a child subreaper (descendants of
the workers, and orphans re-parented to it), and the run token in the environment
(processes the kernel re-parented elsewhere).  ``ProcessContext`` (``workers.py``)
inherits it; the scan reads the process table through psutil.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Protocol

import psutil

from stalwart.base import envvars
from stalwart.launch.workers.cgroup import JobCgroup
from stalwart.launch.workers.guardian import Guardian
from stalwart.launch.workers.warm import WarmPool


class _HasPid(Protocol):
    @property
    def pid(self) -> int: ...


class StrayScan:
    """The scan and the kill; the worker group's fields it reads are declared here."""

    _workers: Mapping[int, _HasPid]
    warm: WarmPool | None
    guardian: Guardian | None
    cgroup: JobCgroup | None
    adopt_orphans: bool
    run_token: str
    _preexisting: set[int]

    def _templates_paused(self) -> contextlib.AbstractContextManager[None]:
        """While the launcher's children are scanned, no warm template is forked: one
        born mid-scan is not yet among those spared, and would look like an orphan."""
        return self.warm.paused() if self.warm is not None else contextlib.nullcontext()

    def strays(self) -> dict[int, float]:
        """Descendants of the workers, and orphans re-parented to us, that left every
        worker's process group (pid -> start time): what a group kill would miss."""
        with self._templates_paused():
            return self._strays()

    def _strays(self) -> dict[int, float]:
        groups = {w.pid for w in self._workers.values()}
        # One pass over the process table per call (this runs every half second), not
        # one per worker as psutil's recursive children() would.
        tree = _process_tree()
        found = {p for w in groups for p in _below(tree, w)}
        if self.adopt_orphans:
            spare = self._spare()
            for pid in tree.get(os.getpid(), ()):
                if pid not in spare and pid not in groups and pid not in self._preexisting:
                    found.add(pid)
                    found.update(_below(tree, pid))
        out: dict[int, float] = {}
        for pid in found:
            try:
                if os.getpgid(pid) in groups:
                    continue
                out[pid] = psutil.Process(pid).create_time()
            except (OSError, psutil.Error):
                continue
        return out

    def _descendants_of_workers(self, pids: list[int]) -> set[int]:
        """Everything below the worker processes *pids*, from one read of the process
        table before they are signalled, however many workers there are (psutil's
        ``children`` reads the whole table on each call: one per worker made the
        survivors' SIGTERM wait on nproc passes).  A worker that is not our descendant
        (no child subreaper to inherit a warm worker) is looked up on its own."""
        tree = descendants_tree(os.getpid())
        ours = {p for kids in tree.values() for p in kids}
        found: set[int] = set()
        for pid in pids:
            found |= _below(tree, pid) if pid in ours else set(children_of(pid, recursive=True))
        return found

    def _spare(self) -> set[int]:
        """Helpers that serve the next attempt or guard the job: never killed here."""
        spare = {os.getpid()}
        if self.warm is not None:
            spare.update(self.warm.owned_pids())
        if self.guardian is not None:
            spare.add(self.guardian.proc.pid)
        return spare

    def _kill_strays(self, descendants: set[int]) -> None:
        """Kills whatever the workers started that outlives them, by all three nets."""
        with self._templates_paused():
            self._kill_strays_now(descendants)

    def _kill_strays_now(self, descendants: set[int]) -> None:
        spare = self._spare()
        worker_pids = {w.pid for w in self._workers.values()}
        if self.cgroup is not None:
            self.cgroup.kill_except(spare)
        victims = set(descendants)
        # One read of the process table for the orphans and the token sweep together:
        # the next attempt waits for this.
        tree = descendants_tree(os.getpid())
        if self.adopt_orphans:
            for pid in tree.get(os.getpid(), ()):
                if pid in spare or pid in worker_pids or pid in self._preexisting:
                    continue
                victims.add(pid)
                victims.update(_below(tree, pid))
        if self.run_token:
            victims.update(self._with_token(tree))
        victims -= spare
        for pid in victims:
            try:
                child = psutil.Process(pid)
                child.kill()
                if child.ppid() == os.getpid() and pid not in worker_pids:
                    child.wait(1)  # reap re-parented grandchildren (we are subreaper)
            except psutil.Error:
                pass

    def _with_token(self, tree: dict[int, list[int]]) -> list[int]:
        """Our descendants in *tree* that carry the run token (the warm template too:
        the caller spares it)."""
        found = []
        for child in _below(tree, os.getpid()):
            try:
                env = psutil.Process(child).environ()
            except psutil.Error:
                continue
            if env.get(envvars.RUN_TOKEN) == self.run_token:
                found.append(child)
        return found


def descendants_tree(root: int) -> dict[int, list[int]]:
    """parent pid -> child pids over *root*'s descendants: one pass over the process
    table, then each descendant's parent (a small read per process of our own tree,
    not of the whole table); empty if *root* is gone."""
    tree: dict[int, list[int]] = {}
    try:
        below = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return tree
    ours = {proc.pid for proc in below}
    for proc in below:
        try:
            parent = proc.ppid()
        except psutil.Error:
            continue  # gone since the pass: nothing below it to find either
        # Its parent died since the pass and it went to init: still ours to find.
        tree.setdefault(parent if parent in ours else root, []).append(proc.pid)
    return tree


def _process_tree() -> dict[int, list[int]]:
    """parent pid -> child pids, from one pass over the process table."""
    tree: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        ppid = proc.info["ppid"]
        if ppid is not None:
            tree.setdefault(ppid, []).append(proc.pid)
    return tree


def _below(tree: dict[int, list[int]], pid: int) -> set[int]:
    """All descendants of *pid* in *tree*."""
    out: set[int] = set()
    todo = list(tree.get(pid, ()))
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(tree.get(p, ()))
    return out


def children_of(pid: int, recursive: bool) -> list[int]:
    """The pids of *pid*'s children (all descendants when *recursive*); none if gone."""
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=recursive)]
    except psutil.Error:
        return []
