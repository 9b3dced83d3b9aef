"""Ray's folders are the operator's alone. Ray makes every folder it creates 0777 (its temp dir,
each session's, its sockets and logs: `ray._common.utils.try_make_directory_shared`), so the stack
puts each node's temp dir inside a 0700 home of its own: on the test stack (whose state dir is long,
so the home is a stand-in in the shared /tmp) another user really tries to list and plant files
there, and a home someone else made first is refused."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from opentinker.control.services import is_stand_in, private_ray_dir, ray_dir, ray_temp_dir

NOBODY = 65534


def world_reachable(root: Path) -> list[Path]:
    """The folders under `root` (itself included) that any user can walk into: every folder on the
    way from / has the others' search bit."""
    def searchable(folder: Path) -> bool:
        return all(os.stat(p).st_mode & stat.S_IXOTH for p in [folder, *folder.parents])

    folders = [root] + [Path(top) / name for top, names, _ in os.walk(root) for name in names]
    return [f for f in folders if not f.is_symlink() and searchable(f)]


def as_nobody(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", capture_output=True, text=True, timeout=30)


def test_no_folder_of_the_stack_that_others_reach_is_writable_by_them(stack):
    settings, _ = stack
    head = ray_temp_dir(settings)
    home = head.parent
    info = home.stat()
    assert (stat.S_IMODE(info.st_mode), info.st_uid) == (0o700, os.getuid())
    sockets = next(head.glob("session_*/sockets"))  # where the raylet's and the object store's sockets live
    for root in (settings.state_dir, home):
        open_to_all = [p for p in world_reachable(root) if p.stat().st_mode & stat.S_IWOTH]
        assert not open_to_all, open_to_all
    assert not {home, head, sockets} & set(world_reachable(home))


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user (uid 65534) needs root")
def test_another_user_can_neither_list_nor_plant_files_in_rays_folders(stack):
    settings, _ = stack
    head = ray_temp_dir(settings)
    sockets = next(head.glob("session_*/sockets"))
    for folder in (head.parent, head, sockets):
        listing = as_nobody(shutil.which("ls"), str(folder))
        assert listing.returncode != 0 and "Permission denied" in listing.stderr, (folder, listing)
        planted = folder / "planted-by-nobody"
        touch = as_nobody(shutil.which("touch"), str(planted))
        assert touch.returncode != 0 and "Permission denied" in touch.stderr, (folder, touch)
        assert not planted.exists()


@pytest.fixture
def stand_in_home(tmp_path):
    """A state dir whose Ray folders would not fit Ray's socket names: their home is a stand-in in /tmp."""
    state = tmp_path / ("state-" + "x" * 40)
    assert is_stand_in(ray_dir(state, "head"))
    home = ray_dir(state, "head").parent
    yield state, home
    if home.is_symlink():
        home.unlink()
    else:
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder of another user needs root")
def test_a_ray_home_another_user_made_first_is_refused_in_one_line(stand_in_home):
    state, home = stand_in_home
    home.mkdir()
    os.chmod(home, 0o777)
    os.chown(home, NOBODY, NOBODY)
    with pytest.raises(PermissionError) as refused:
        private_ray_dir(state, "head")
    assert str(refused.value) == f"Ray's folder {home} is not a folder of uid 0 (a link, or another user's): remove it"
    assert stat.S_IMODE(home.stat().st_mode) == 0o777 and home.stat().st_uid == NOBODY  # not taken over either


def test_a_ray_home_that_is_a_link_is_refused(stand_in_home, tmp_path):
    state, home = stand_in_home
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    home.symlink_to(elsewhere)
    with pytest.raises(PermissionError, match="a link, or another user's"):
        private_ray_dir(state, "head")


def test_an_open_ray_home_of_ours_is_closed():
    """A state dir from before kept Ray's own 0777 `<state>/ray`: the next start makes it 0700."""
    state = Path(tempfile.mkdtemp(prefix="ot-"))  # short: its Ray home is `<state>/ray` itself
    try:
        (state / "ray").mkdir()
        os.chmod(state / "ray", 0o777)
        assert private_ray_dir(state, "head") == state / "ray" / "head"
        assert stat.S_IMODE((state / "ray").stat().st_mode) == 0o700
    finally:
        shutil.rmtree(state)
