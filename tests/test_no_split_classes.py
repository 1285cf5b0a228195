"""No class of stalwart is split into parent classes that live in other modules.

A class that inherits from two or more classes of the project defined elsewhere shares
its state across files (issue 21): a part should be an object the class owns instead.
The check reads the source with `ast` (no import), resolving each base through the
module's own imports.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "stalwart"


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    # A package's own __init__ is its level-1 anchor; a module's is its package.
    keep = len(base) - node.level + (1 if is_package else 0)
    anchor = base[:keep]
    return ".".join(anchor + ([node.module] if node.module else []))


def project_bases(source: str, module: str, is_package: bool) -> dict[str, list[str]]:
    """Class name -> the bases it takes from other modules of the project."""
    tree = ast.parse(source)
    names: dict[str, str] = {}  # local name -> the project module it comes from
    modules: dict[str, str] = {}  # local alias -> a project module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            origin = _absolute(module, node, is_package)
            if origin.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                names[alias.asname or alias.name] = origin
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    modules[alias.asname or alias.name] = alias.name
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        found = []
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in names and names[base.id] != module:
                found.append(f"{names[base.id]}.{base.id}")
            elif isinstance(base, ast.Attribute):
                dotted = ast.unparse(base.value)
                origin = modules.get(dotted)
                if origin is None and isinstance(base.value, ast.Name) and base.value.id in names:
                    origin = f"{names[base.value.id]}.{base.value.id}"  # from pkg import mod
                if origin is not None and origin != module:
                    found.append(f"{origin}.{base.attr}")
        out[node.name] = found
    return out


@functools.cache
def split_classes(root: Path) -> list[str]:
    """Each `module.Class` of the tree under `root` with two or more such bases."""
    bad: list[str] = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root.parent)
        bases = project_bases(path.read_text(), module, path.name == "__init__.py")
        for cls, found in sorted(bases.items()):
            if len(found) > 1:
                bad.append(f"{module}.{cls}({', '.join(found)})")
    return bad


@pytest.mark.parametrize(
    ("source", "module", "expected"),
    [
        # Two parents from other modules of the project: split.
        ("from stalwart.a import A\nfrom stalwart.b import B\nclass C(A, B): ...",
         "stalwart.c", ["stalwart.a.A", "stalwart.b.B"]),
        # Relative imports and module attributes resolve the same way.
        ("from .a import A\nfrom . import b\nclass C(A, b.B): ...",
         "stalwart.pkg.c", ["stalwart.pkg.a.A", "stalwart.pkg.b.B"]),
        ("import stalwart.a as m\nfrom stalwart.b import B\nclass C(m.A, B): ...",
         "stalwart.c", ["stalwart.a.A", "stalwart.b.B"]),
        # One project parent, library parents, and parents of the same module: allowed.
        ("import abc, threading\nfrom stalwart.a import A\nclass C(A, abc.ABC): ...",
         "stalwart.c", ["stalwart.a.A"]),
        ("from enum import Enum\nclass A: ...\nclass B(A, Enum): ...", "stalwart.c", []),
    ],
)  # fmt: skip
def test_bases_are_resolved(source: str, module: str, expected: list[str]) -> None:
    assert project_bases(source, module, False)[source.rsplit("class ", 1)[1][0]] == expected


def test_a_tree_with_a_split_class_is_named(tmp_path: Path) -> None:
    root = tmp_path / PACKAGE
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("class A: ...\n")
    (root / "b.py").write_text("class B: ...\n")
    (root / "c.py").write_text("from stalwart.a import A\nfrom .b import B\nclass C(A, B): ...\n")
    assert split_classes(root) == ["stalwart.c.C(stalwart.a.A, stalwart.b.B)"]


LAUNCH = "stalwart.launch."


def test_no_class_outside_launch_is_split_across_modules() -> None:
    bad = [c for c in split_classes(SRC / PACKAGE) if not c.startswith(LAUNCH)]
    assert bad == [], "\n".join(bad)


def test_no_class_in_launch_is_split_across_modules() -> None:
    bad = [c for c in split_classes(SRC / PACKAGE) if c.startswith(LAUNCH)]
    assert bad == [], "\n".join(bad)
