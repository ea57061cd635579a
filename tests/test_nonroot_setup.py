"""`make setup` for someone who is not root: the Debian packages only the tests use are not
installable without root, so setup prints the one apt command and goes on (make demo works);
`make test` still refuses to start without them. Run as a real non-root user (useradd) when the
tests run as root, else as the current user."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "packaging" / "apt-packages.sh"
USER = "kvops-nonroot"
MISSING = "kvops-no-such-package"  # not installed anywhere: the missing-package path for real


@pytest.fixture(scope="module")
def as_user() -> Iterator[list[str]]:
    """The command prefix that runs as the non-root user, who runs a copy of the script: the
    checkout itself may sit in a folder only root may enter (a mktemp -d clone)."""
    if os.geteuid() != 0:
        yield ["sh", str(SCRIPT)]
        return
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", USER], check=True)
    readable = Path(tempfile.mkdtemp(prefix="kvops-nonroot-"))
    readable.chmod(0o755)
    script = shutil.copyfile(SCRIPT, readable / SCRIPT.name)
    script.chmod(0o644)
    yield ["runuser", "-u", USER, "--", "sh", str(script)]
    shutil.rmtree(readable)


def _run(prefix: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, *args], capture_output=True, text=True,
                          timeout=60, check=False, cwd="/")


def test_setup_as_non_root_prints_the_one_apt_command_and_goes_on(as_user):
    if as_user[0] == "runuser":
        assert subprocess.run([*as_user[:4], "id", "-u"], capture_output=True, text=True).stdout.strip() != "0"
    res = _run(as_user, "install", "dpkg", MISSING)
    assert res.returncode == 0, res.stderr
    assert f"sudo apt-get install -y --no-install-recommends {MISSING}" in res.stdout
    assert "apt: installing" not in res.stdout  # nothing tried without root


def test_test_needs_the_packages_and_says_which_command(as_user):
    res = _run(as_user, "require", "dpkg", MISSING)
    assert res.returncode == 1
    assert f"sudo apt-get install -y --no-install-recommends {MISSING}" in res.stderr
    assert _run(as_user, "require", "dpkg").returncode == 0
