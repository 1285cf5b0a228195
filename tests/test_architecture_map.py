"""docs/architecture.md's arrows are the code's: the ``arrows`` block there lists, for each
part of stalwart, the parts it imports; this test reads every module's imports (ast: lazy,
``TYPE_CHECKING`` and relative ones included) and fails both ways, on an arrow drawn that
no import makes and on an import between parts that no arrow draws.  It also checks that
every module of a mapped package appears in that package's file map."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "stalwart"
DOC = ROOT / "docs" / "architecture.md"

pytestmark = pytest.mark.timeout(60)

Arrows = dict[str, set[str]]


def part_of(module: str) -> str | None:
    """The part a dotted module belongs to: a top-level package or module, or one of
    ``launch``'s rooms (``launch.round``); ``launch`` itself is its ``__init__``."""
    names = module.split(".")
    if names[0] != "stalwart" or len(names) < 2:
        return None
    if names[1] == "launch" and len(names) > 2 and (SRC / "launch" / names[2]).is_dir():
        return f"launch.{names[2]}"
    return names[1]


def module_name(path: Path) -> str:
    names = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(names[:-1] if names[-1] == "__init__" else names)


def imported(path: Path) -> set[str]:
    """Every module `path` imports, absolute, with ``from X import y`` also as ``X.y``
    (``y`` may be a module)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[: len(package) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def code_arrows() -> Arrows:
    arrows: Arrows = {}
    for path in sorted(SRC.rglob("*.py")):
        source = part_of(module_name(path))
        if source is None:
            continue
        arrows.setdefault(source, set())
        for target in map(part_of, imported(path)):
            if target is not None and target != source:
                arrows[source].add(target)
    return arrows


def parse_arrows(text: str) -> Arrows:
    """The doc's block: one ``part -> a, b, c`` line per part (``-> -`` for none)."""
    block = re.search(r"^```arrows\n(.*?)^```", text, re.S | re.M)
    if block is None:
        raise AssertionError(f"{DOC.name} has no ```arrows block")
    arrows: Arrows = {}
    for number, line in enumerate(block.group(1).splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        source, sep, targets = line.partition("->")
        if not sep or not source.strip():
            raise AssertionError(f"arrows line {number}: expected 'part -> a, b', got {line!r}")
        names = {t.strip() for t in targets.split(",") if t.strip() and t.strip() != "-"}
        arrows[source.strip()] = names
    return arrows


def difference(drawn: Arrows, code: Arrows) -> list[str]:
    """What disagrees, one line each (empty when the map is true)."""
    lines = [f"part not drawn: {p}" for p in sorted(code.keys() - drawn.keys())]
    lines += [f"part drawn that does not exist: {p}" for p in sorted(drawn.keys() - code.keys())]
    for part in sorted(drawn.keys() & code.keys()):
        lines += [f"drawn, no import: {part} -> {t}" for t in sorted(drawn[part] - code[part])]
        lines += [f"import, not drawn: {part} -> {t}" for t in sorted(code[part] - drawn[part])]
    return lines


def test_the_drawn_arrows_are_the_imports() -> None:
    problems = difference(parse_arrows(DOC.read_text()), code_arrows())
    assert not problems, "docs/architecture.md disagrees with the code:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("drawn", "expected"),
    [
        ({"a": {"b"}, "b": set()}, []),
        ({"a": {"b", "c"}, "b": set()}, ["drawn, no import: a -> c"]),
        ({"a": set(), "b": set()}, ["import, not drawn: a -> b"]),
        ({"a": {"b"}}, ["part not drawn: b"]),
        ({"a": {"b"}, "b": set(), "z": set()}, ["part drawn that does not exist: z"]),
    ],
)
def test_difference_fails_both_ways(drawn: Arrows, expected: list[str]) -> None:
    assert difference(drawn, {"a": {"b"}, "b": set()}) == expected


@pytest.mark.parametrize(
    "text",
    ["no block here", "```arrows\ncli launch\n```\n", "```arrows\n -> base\n```\n"],
)
def test_a_malformed_map_is_named_not_read_as_empty(text: str) -> None:
    with pytest.raises(AssertionError):
        parse_arrows(text)


#: Packages whose file map (a table naming each module) the doc keeps.
MAPPED = (
    "launch/round",
    "launch/workers",
    "launch/replicas",
    "launch/files",
    "rendezvous",
    "checkpoint",
    "inprocess",
    "config",
    "base",
    "reporting",
    "health",
)


@pytest.mark.parametrize("package", MAPPED)
def test_every_module_is_in_its_package_file_map(package: str) -> None:
    text = DOC.read_text()
    heading = re.search(rf"^### `{re.escape(package)}/`\n(.*?)(?=^##)", text, re.S | re.M)
    assert heading is not None, f"no '### `{package}/`' file map in {DOC.name}"
    named = set(re.findall(r"`([a-z_]+)\.py`", heading.group(1)))
    modules = {p.stem for p in (SRC / package).glob("*.py") if p.name != "__init__.py"}
    assert not modules - named, f"{package}: not in the map: {sorted(modules - named)}"
    assert not named - modules, f"{package}: mapped but gone: {sorted(named - modules)}"
