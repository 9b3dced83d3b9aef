"""Debian packages the suite needs, as fixtures: `bubblewrap` (the sandbox) and `chromium` (the
console's browser tests). A test skips for a missing package only where the README's commands
could not have installed it (infra/system-packages.sh installs them as root with apt-get); there
the package's absence is a failure that names the script, never a skip that hides the tests."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.cdp import chromium as chromium_path


def require(present: bool, package: str, what: str) -> None:
    if present:
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        pytest.fail(f"Debian's {package} is missing on a machine that can install it (root, apt-get): "
                    f"`bash infra/system-packages.sh` (which `make install` runs) installs it; {what} needs it")
    pytest.skip(f"{what} needs Debian's {package}: `sudo apt-get install {package}` (what infra/system-packages.sh does as root)")


@pytest.fixture(scope="session")
def bubblewrap() -> None:
    from opentinker.tools.sandbox import BWRAP

    require(bool(shutil.which("bwrap") or os.access(BWRAP, os.X_OK)), "bubblewrap", "the sandbox")


@pytest.fixture(scope="session")
def chromium() -> str:
    require(chromium_path() is not None, "chromium", "the console's browser tests")
    return chromium_path()
