"""The module map of docs/architecture.md, enforced: what vLLM imports (the
client and the connector) pulls in nothing of the server, and bookkeeping pulls
in no copy engine or driver. Module-level imports only: a function's lazy
import is the documented way to reach optional, heavy code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"pegaflow": "pegaflow", "pegaflow.kernels": "kernels"}
PACKAGES |= {"pegaflow.gds": "gds", "pegaflow.connector": "connector"}

SERVER = {
    "pegaflow.server.engine",
    "pegaflow.server.query_path",
    "pegaflow.tiers.remote.link",
    "pegaflow.tiers.remote.fetch",
    "pegaflow.tiers.remote.pins",
    "pegaflow.tiers.remote.peer_service",
    "pegaflow.tiers.remote.bringup",
    "pegaflow.server.grpc_service",
    "pegaflow.server",
    "pegaflow.server.socket_service",
    "pegaflow.cache.block_store",
    "pegaflow.cache.block_entry",
    "pegaflow.cache.tier_loads",
    "pegaflow.cache.deferred_touches",
    "pegaflow.cache.pool",
    "pegaflow.cache.slabs",
    "pegaflow.cache.eviction",
    "pegaflow.cache.leases",
    "pegaflow.cache.miss_reasons",
    "pegaflow.cache.ready_index",
    "pegaflow.cache.hash_table",
    "pegaflow.cache.instances",
    "pegaflow.server.namespaces",
    "pegaflow.tiers.ssd_tier",
    "pegaflow.server.report",
    "pegaflow.server.status_command",
    "pegaflow.server.metrics",
    "pegaflow.daemon.boundary",
    "pegaflow.common.request_limits",
    "pegaflow.cli",
    "pegaflow.common.config",
}
BOOKKEEPING = [
    "pegaflow.cache.block_store",
    "pegaflow.cache.block_entry",
    "pegaflow.cache.tier_loads",
    "pegaflow.cache.deferred_touches",
    "pegaflow.cache.eviction",
    "pegaflow.cache.leases",
    "pegaflow.cache.miss_reasons",
    "pegaflow.cache.ready_index",
    "pegaflow.cache.hash_table",
    "pegaflow.cache.instances",
    "pegaflow.server.namespaces",
    "pegaflow.cache.pool",
    "pegaflow.cache.slabs",
]
COPY_OR_DRIVER = (
    "pegaflow.copiers.",
    "pegaflow.common.cuda_driver",
    "pegaflow.kernels",
)
COPY_PROTOCOLS = "pegaflow.copiers.copier"  # types only: allowed everywhere


def _path(module: str) -> Path | None:
    for prefix, folder in sorted(PACKAGES.items(), key=lambda p: -len(p[0])):
        if module == prefix or module.startswith(prefix + "."):
            rest = module[len(prefix) :].lstrip(".").replace(".", "/")
            base = ROOT / folder / rest if rest else ROOT / folder
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return candidate
    return None


def _imports(module: str) -> set[str]:
    """Our modules that `module` imports at module level (not TYPE_CHECKING)."""
    path = _path(module)
    if path is None:
        return set()
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        found |= _node_imports(node, package)
    return {m for m in found if m.startswith("pegaflow")}


def _node_imports(node: ast.stmt, package: str) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return set()  # a lazy import inside a function or method
    out: set[str] = set()
    if isinstance(node, ast.Import):
        out |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            parent = parts[: len(parts) - node.level + 1]
            base = ".".join(parent + ([base] if base else []))
        out.add(base)
        out |= {f"{base}.{alias.name}" for alias in node.names}
    else:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                out |= _node_imports(child, package)
    return {m for m in out if _path(m) is not None}


def _closure(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(_imports(module))
    return seen


@pytest.mark.parametrize("entry", ["pegaflow.client", "pegaflow.connector"])
def test_what_vllm_imports_needs_nothing_of_the_server(entry: str) -> None:
    assert _path(entry) is not None
    pulled = _closure(entry) & SERVER
    assert not pulled, f"{entry} pulls in server modules: {sorted(pulled)}"


@pytest.mark.parametrize("module", BOOKKEEPING)
def test_bookkeeping_imports_no_copy_engine_or_driver(module: str) -> None:
    bad = {
        m
        for m in _closure(module)
        if m.startswith(COPY_OR_DRIVER) and not m.startswith(COPY_PROTOCOLS)
    }
    assert not bad, f"{module} pulls in {sorted(bad)}"


def test_the_rules_can_fail() -> None:
    """The checker sees a real import: the engine does pull in the copiers."""
    assert "pegaflow.copiers.layer_signals" in _closure("pegaflow.server.engine")
    assert "pegaflow.cache.block_store" in _closure("pegaflow.server.engine")


def _import_style_faults(folder: str, package: str) -> list[str]:
    """Absolute imports of a sibling in the same folder tree (they must be
    relative), and relative imports that climb out of the folder (they fail
    when a checkout's folder is imported as a top-level package)."""
    others = tuple(p for p in PACKAGES if p != package and p.startswith(package))
    faults = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if "_pb2" in path.name:
            continue
        depth = len(path.relative_to(ROOT / folder).parts) - 1  # packages below
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom | ast.Import):
                continue
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
            )
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if getattr(node, "level", 0) > depth + 1:
                faults.append(f"{where} climbs out of {folder}/")
            for name in names:
                if getattr(node, "level", 0):
                    continue
                inside = name == package or name.startswith(package + ".")
                elsewhere = name in others or name.startswith(
                    tuple(o + "." for o in others)
                )
                if inside and not elsewhere:
                    faults.append(f"{where} imports {name} absolutely")
    return faults


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_one_import_style_inside_each_folder(package: str) -> None:
    assert not _import_style_faults(PACKAGES[package], package)


def test_the_style_check_can_fail(tmp_path, monkeypatch) -> None:
    (tmp_path / "gds").mkdir()
    (tmp_path / "gds" / "a.py").write_text(
        "from pegaflow.gds.format import X\nfrom ..errors import Y\n"
    )
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    faults = _import_style_faults("gds", "pegaflow.gds")
    assert len(faults) == 2, faults
