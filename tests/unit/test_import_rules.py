"""The rooms of docs/architecture.md, enforced by folder: each room may import
only the rooms its rule names (a few prefixes each, no module lists), no two
rooms or modules import each other in a circle, and inside a room siblings are
imported relatively, across rooms absolutely.

Every import counts: module level, inside functions (lazy) and under
TYPE_CHECKING. An arrow a reader has to follow is an arrow, whenever it runs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Import name -> folder of the checkout (installed, the three land in pegaflow/).
TOP_FOLDERS = {
    "pegaflow": "pegaflow",
    "pegaflow.kernels": "kernels",
    "pegaflow.gds": "gds",
    "pegaflow.connector": "connector",
}
COMMON, PROTO = "pegaflow.common", "pegaflow.proto"
# Room -> the rooms (or modules) it may import besides itself. Arrows point
# down: server -> cache / tiers / copiers -> common.
RULES: dict[str, tuple[str, ...]] = {
    "pegaflow.common": (),
    "pegaflow.proto": (),
    "pegaflow.daemon": (COMMON,),
    "pegaflow.kernels": (COMMON,),
    "pegaflow.gds": (COMMON,),
    "pegaflow.client": (COMMON, PROTO),
    "pegaflow.connector": (COMMON, "pegaflow.client"),
    "pegaflow.copiers": (COMMON, "pegaflow.kernels"),
    # Bookkeeping: the copiers' protocols (types), never a copy engine.
    "pegaflow.cache": (COMMON, "pegaflow.copiers.copier"),
    "pegaflow.metaserver": (COMMON, PROTO, "pegaflow.daemon"),
    "pegaflow.tiers": (
        COMMON,
        PROTO,
        "pegaflow.daemon",
        "pegaflow.cache",
        "pegaflow.copiers",
        "pegaflow.gds",
        "pegaflow.metaserver.meta_client",
    ),  # fmt: skip
    "pegaflow.server": (
        COMMON,
        PROTO,
        "pegaflow.daemon",
        "pegaflow.cache",
        "pegaflow.copiers",
        "pegaflow.gds",
        "pegaflow.kernels",
        "pegaflow.tiers",
    ),  # fmt: skip
    "pegaflow.demo": (COMMON, "pegaflow.client"),
    # pegaflow/*.py: the facades users and vLLM name (errors, kv_layouts, cli).
    "pegaflow": (COMMON, "pegaflow.client", "pegaflow.server"),
}
MAX_FACADES = 8  # modules directly in pegaflow/
# A room with nothing heavy: what vLLM's processes import.
ENGINE_SIDE = ("pegaflow.client", "pegaflow.connector")


@dataclass(frozen=True, slots=True)
class Arrow:
    source: str
    target: str
    where: str  # path:line
    level: int  # 0: absolute


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every product module by import name (generated protobuf code aside)."""
    out: dict[str, Path] = {}
    for package, folder in TOP_FOLDERS.items():
        base = root / folder
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("").parts
            if "_pb2" in path.name or (package == "pegaflow" and rel[0] in _TOPS):
                continue
            parts = rel[:-1] if rel[-1] == "__init__" else rel
            out[".".join((package, *parts))] = path
    return out


_TOPS = {"kernels", "gds", "connector"}  # a checkout may hold them under pegaflow/


def room(module: str) -> str:
    """The rule that governs a module: the longest RULES prefix."""
    for prefix in sorted(RULES, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return prefix
    raise KeyError(module)


def arrows(root: Path = ROOT) -> Iterator[Arrow]:
    """Each import of one of our modules, from each module."""
    mods = modules(root)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            for target, level in _targets(node, package):
                # A module's own packages run before it anyway: not an arrow.
                if target in mods and not name.startswith(target + "."):
                    yield Arrow(name, target, f"{path.relative_to(root)}:{node.lineno}",
                                level)  # fmt: skip


def _targets(node: ast.AST, package: str) -> list[tuple[str, int]]:
    if isinstance(node, ast.Import):
        return [(alias.name, 0) for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
    names = [f"{base}.{alias.name}" for alias in node.names]
    return [(base, node.level), *((n, node.level) for n in names)]


def _allowed(source: str, target: str) -> bool:
    mine = room(source)
    if room(target) == mine or target == "pegaflow":  # the package: __version__
        return True
    return any(target == p or target.startswith(p + ".") for p in RULES[mine])


def rule_faults(root: Path = ROOT) -> list[str]:
    return sorted(
        f"{a.where}: {room(a.source)} may not import {a.target}"
        for a in arrows(root)
        if not _allowed(a.source, a.target)
    )


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected parts of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def graphs(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module -> modules, room -> rooms) over every arrow."""
    by_module: dict[str, set[str]] = {}
    by_room: dict[str, set[str]] = {}
    for a in arrows(root):
        by_module.setdefault(a.source, set()).add(a.target)
        if room(a.source) != room(a.target):
            by_room.setdefault(room(a.source), set()).add(room(a.target))
    return by_module, by_room


def style_faults(root: Path = ROOT) -> list[str]:
    """Absolute imports of the module's own room (siblings are relative, so a
    room moves as a unit), and relative ones that reach into another room."""
    faults = []
    for a in arrows(root):
        same = room(a.source) == room(a.target)
        if same and a.level == 0 and room(a.source) != "pegaflow":
            faults.append(f"{a.where}: {a.target} of the same room, absolutely")
        elif not same and a.level:
            faults.append(f"{a.where}: {a.target} of another room, relatively")
    return sorted(set(faults))


def test_every_module_has_a_room_and_few_sit_at_the_top() -> None:
    mods = modules()
    assert "pegaflow.server.engine" in mods and "pegaflow.gds.tier" in mods
    facades = [m for m in mods if room(m) == "pegaflow" and m != "pegaflow"]
    assert len(facades) <= MAX_FACADES, facades


def test_each_room_imports_only_what_its_rule_allows() -> None:
    faults = rule_faults()
    assert not faults, "\n".join(faults)


def test_no_cycle_between_rooms_or_modules() -> None:
    by_module, by_room = graphs()
    assert not cycles(by_room), cycles(by_room)
    assert not cycles(by_module), cycles(by_module)


def test_siblings_relative_other_rooms_absolute() -> None:
    faults = style_faults()
    assert not faults, "\n".join(faults)


def test_no_two_modules_share_a_basename() -> None:
    """Two `policy.py` in two rooms read as one; a facade re-exporting its home
    (pegaflow/errors.py) and a package's __init__/__main__ are not a second name."""
    seen: dict[str, str] = {}
    clashes = []
    for name, path in modules().items():
        if path.name in ("__init__.py", "__main__.py") or room(name) == "pegaflow":
            continue
        other = seen.setdefault(path.name, name)
        if other != name:
            clashes.append(f"{other} and {name}")
    assert not clashes, clashes


@pytest.mark.parametrize("entry", ENGINE_SIDE)
def test_what_vllm_imports_stays_on_the_engine_side(entry: str) -> None:
    by_module, _ = graphs()
    seen, todo = set(), [entry]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(by_module.get(module, ()))
    outside = {m for m in seen if room(m) not in (*ENGINE_SIDE, COMMON, PROTO)}
    assert len(seen) > 5 and not outside, sorted(outside)


def test_a_planted_cross_room_cycle_fails(tmp_path: Path) -> None:
    """The checker reads a real tree: common importing the server (and the
    server common) breaks the rule, closes a circle of rooms and of modules,
    and the absolute sibling import breaks the style."""
    for rel, text in {
        "pegaflow/__init__.py": "",
        "pegaflow/common/__init__.py": "",
        "pegaflow/common/keys.py": "from pegaflow.server import engine\n",
        "pegaflow/server/__init__.py": "",
        "pegaflow/server/engine.py": (
            "from pegaflow.common.keys import X\nfrom pegaflow.server import limits\n"
        ),
        "pegaflow/server/limits.py": "",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    faults = rule_faults(tmp_path)
    assert faults == ["pegaflow/common/keys.py:1: pegaflow.common may not import "
                      "pegaflow.server"] or len(faults) == 2, faults  # fmt: skip
    assert all("pegaflow.common may not import pegaflow.server" in f for f in faults)
    by_module, by_room = graphs(tmp_path)
    assert cycles(by_room) == [["pegaflow.common", "pegaflow.server"]]
    assert cycles(by_module) == [["pegaflow.common.keys", "pegaflow.server.engine"]]
    assert style_faults(tmp_path) == [
        "pegaflow/server/engine.py:2: pegaflow.server.limits of the same room, "
        "absolutely"
    ]
