"""Every folder of Python code in the package is a listed, importable package:
a folder missing from pyproject's `packages` (or its __init__.py) works from a
checkout and is silently absent from the wheel (pegaflow/remote once was)."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_every_code_folder_is_a_listed_package() -> None:
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    mapped = {Path(v): k for k, v in setup.get("package-dir", {}).items()}
    found = {}
    for top in ("pegaflow", *map(str, mapped)):
        for folder in sorted((ROOT / top).rglob("*")):
            if not folder.is_dir() or "__pycache__" in folder.parts:
                continue
            if not any(folder.glob("*.py")):
                continue
            rel = folder.relative_to(ROOT)
            base = mapped.get(Path(rel.parts[0]), rel.parts[0])
            found[".".join([base, *rel.parts[1:]])] = folder
    for name in ("pegaflow", *mapped.values()):
        found.setdefault(name, ROOT)
    missing = sorted(set(found) - listed)
    assert not missing, f"folders of code not in pyproject packages: {missing}"
    no_init = sorted(n for n, f in found.items() if not (f / "__init__.py").exists()
                     and f != ROOT)  # fmt: skip
    assert not no_init, f"packages without __init__.py: {no_init}"
