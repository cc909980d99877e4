"""The cache files hold every tenant's KV bytes: created 0600, opened only as
private regular files of the server's user (never through a link), and locked
per file, whatever name reaches it."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from pegaflow.gds import SsdConfig, SsdError, SsdTier
from tests.gds.helpers import BACKEND, config, load, opened, spill


def _mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_files_are_created_private(tmp_path: Path) -> None:
    cfg = config(tmp_path, files=2, capacity=4 << 20)
    with opened(cfg) as tier:
        spill(tier, [1])
    for path in (*cfg.paths, cfg.journal_path):
        assert _mode(path) == 0o600, path


def _group_writable(path: str, tmp: Path) -> str:
    os.chmod(path, 0o660)
    return "has mode 660.*chmod 600"


def _symlinked(path: str, tmp: Path) -> str:
    os.rename(path, tmp / "elsewhere")
    os.symlink(tmp / "elsewhere", path)
    return "is a symbolic link; name the file itself"


def _hard_linked(path: str, tmp: Path) -> str:
    os.link(path, tmp / "second-name")
    return "has 2 hard links"


def _foreign_owner(path: str, tmp: Path) -> str:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    os.chown(path, 65534, -1)
    return "belongs to uid 65534.*run as its owner"


@pytest.mark.parametrize(
    "damage", [_group_writable, _symlinked, _hard_linked, _foreign_owner]
)
@pytest.mark.parametrize("which", ["data", "journal"])
def test_files_others_could_reach_are_refused(
    tmp_path: Path, damage: Callable[[str, Path], str], which: str
) -> None:
    cfg = config(tmp_path)
    with opened(cfg) as tier:
        spill(tier, [1])
    path = cfg.paths[0] if which == "data" else cfg.journal_path
    why = damage(path, tmp_path)
    with pytest.raises(SsdError, match=f"--ssd-cache-path: .*{why}"):
        SsdTier(cfg)


def test_planted_link_beside_the_journal_is_not_followed(tmp_path: Path) -> None:
    """<journal>.tmp as a symbolic link to a file of the server's user: the
    snapshot writes a file of its own, of another name; the link is left."""
    victim = tmp_path / "precious"
    victim.write_bytes(b"keep me")
    cfg = config(tmp_path)
    tmp = f"{cfg.journal_path}.tmp"
    os.symlink(victim, tmp)
    with opened(cfg) as tier:  # a fresh start writes the journal's snapshot
        spill(tier, [1])
    assert victim.read_bytes() == b"keep me"
    assert os.path.islink(tmp)  # not ours: not removed
    assert stat.S_ISREG(os.lstat(cfg.journal_path).st_mode)
    with opened(cfg) as tier:
        assert tier.store.recovery.rebuilt_by == "journal"
        assert load(tier, [1]).all()


def test_cache_file_of_another_server_by_another_name_is_refused(
    tmp_path: Path,
) -> None:
    """One server on files 0 and 1; another configured with file 1 alone (a
    different first path, so a lock beside the first file would not see it)."""
    both = config(tmp_path, files=2, capacity=4 << 20)
    with opened(both) as tier:
        spill(tier, [1, 2, 3])
        alone = SsdConfig(
            paths=(both.paths[1],),
            capacity_bytes=2 << 20,
            backend=BACKEND,  # type: ignore[arg-type]
            show_progress=False,
        )
        with pytest.raises(SsdError, match="in use by another process"):
            SsdTier(alone)
        assert load(tier, [1, 2, 3]).all()
    with opened(both) as tier:
        assert tier.store.recovery.reinitialised == ""
        assert load(tier, [1, 2, 3]).all()


@pytest.mark.parametrize("which", ["data", "journal"])
def test_a_file_others_could_only_read_is_made_private(
    tmp_path: Path, which: str
) -> None:
    """Earlier versions created the SSD files 0644: such a cache starts, its
    blocks still served, and the file is 0600 from then on."""
    cfg = config(tmp_path)
    with opened(cfg) as tier:
        spill(tier, [1])
    path = cfg.paths[0] if which == "data" else cfg.journal_path
    os.chmod(path, 0o644)
    with opened(cfg) as tier:
        assert load(tier, [1]) == [True]
    assert _mode(path) == 0o600


def test_data_file_swapped_after_its_check_is_not_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: files.py checks and locks each data file on a descriptor,
    then the I/O backend opened the path again by name: a file swapped in
    between (here: renamed over the path) was the one written. Now the
    backend opens the checked file itself (/proc/self/fd), and the swapped-in
    file is never touched."""
    from pegaflow.gds import store as ssd_store

    cfg = config(tmp_path)
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"not the cache" * 1000)
    decoy.chmod(0o600)
    before = decoy.read_bytes()
    real_open = ssd_store.open_backend

    def swap_then_open(*args: object, **kw: object) -> object:
        os.rename(decoy, cfg.paths[0])  # after the check, before the open
        return real_open(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ssd_store, "open_backend", swap_then_open)
    with opened(cfg) as tier:
        spill(tier, [1, 2])
        assert load(tier, [1, 2]).all()
    assert Path(cfg.paths[0]).read_bytes() == before
