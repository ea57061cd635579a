"""The distribution as a user installs it: packages, entry points, import rules."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
FOLDER_OF = {"kvops.core": "core", "kvops.plugin": "plugin", "kvops.ops": "ops", "kvops.loadtest": "loadtest",
             "kvops.runbooks": "runbooks", "kvops": "kvops"}


def _package_dirs() -> set[str]:
    found = set()
    for root, mapped in FOLDER_OF.items():
        base = REPO / mapped
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([root, *rel.parts]) if rel.parts else root)
    return found


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert _package_dirs() - listed == set(), "add these to [tool.setuptools] packages"
    assert listed - _package_dirs() == set(), "listed packages without an __init__.py"


def test_entry_points_name_real_objects():
    eps = PYPROJECT["project"]["entry-points"]
    assert eps["vllm.general_plugins"]["kvops"] == "kvops.plugin:register"
    assert PYPROJECT["project"]["scripts"]["kvops"] == "kvops.ops.cli.main:main"


BLOCK_HEAVY = """
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('vllm', 'torch', 'lmcache'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
{prelude}
pkg = importlib.import_module('{package}')
for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):
    importlib.import_module(mod.name)
print('ok')
"""


@pytest.mark.parametrize(
    ("package", "prelude"),
    [
        ("kvops.core", ""),
        ("kvops.ops", ""),
        # As in a Locust process: locust (and its gevent patching) is imported before our code.
        ("kvops.loadtest", "import locust"),
    ],
)
def test_core_ops_and_loadtest_import_without_vllm_or_torch(package, prelude):
    """Every module imports with vllm/torch/lmcache blocked (an SRE laptop, a Locust worker)."""
    code = BLOCK_HEAVY.format(package=package, prelude=prelude)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


def test_help_imports_no_heavy_module():
    code = (
        "import sys\nfrom typer.testing import CliRunner\nfrom kvops.ops.cli.main import app\n"
        "r = CliRunner().invoke(app, ['--help'])\nassert r.exit_code == 0, r.output\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'transformers'))\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == ""


def test_ops_import_contract_names_every_ops_module_but_cli_and_bench():
    """The 'ops builds on core' contract lists its sources by name: a new ops module is listed."""
    contracts = {c["name"]: c for c in PYPROJECT["tool"]["importlinter"]["contracts"]}
    ops_rule = next(c for name, c in contracts.items() if name.startswith("ops builds on core"))
    children = {f"kvops.ops.{p.stem if p.is_file() else p.name}" for p in (REPO / "ops").iterdir()
                if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert set(ops_rule["source_modules"]) == children - {"kvops.ops.cli", "kvops.ops.bench"}
    cli_rule = next(c for name, c in contracts.items() if name == "nothing imports the CLI")
    assert set(cli_rule["source_modules"]) >= children - {"kvops.ops.cli"}
