"""Package metadata: every third-party import is a declared dependency, and the files a
user looks for (LICENSE, CHANGELOG, version) exist. The public names are imported on
first use, and ``python -m rlcomm status`` imports no torch. The wheel itself is built
and installed into a fresh venv by scripts/check_wheel (CI)."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

import rlcomm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: import name -> distribution name, where they differ.
_DIST_OF = {"yaml": "pyyaml"}


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _third_party_imports() -> set[str]:
    names = set()
    for folder, _, files in os.walk(os.path.join(ROOT, "rlcomm")):
        for name in files:
            if not name.endswith(".py"):
                continue
            with open(os.path.join(folder, name)) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("rlcomm", "__future__")}


def test_every_import_is_a_declared_dependency():
    declared = {
        re.split(r"[<>=!~; \[]", dep, maxsplit=1)[0].lower()
        for dep in _pyproject()["project"]["dependencies"]
    }
    missing = {n for n in _third_party_imports() if _DIST_OF.get(n, n).lower() not in declared}
    assert not missing, f"rlcomm imports {sorted(missing)} but pyproject.toml does not declare them"


def test_metadata_a_user_looks_for():
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    with open(os.path.join(ROOT, "LICENSE")) as f:
        assert "Apache License" in f.read(2000)
    assert project["urls"] and project["classifiers"]
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", rlcomm.__version__)
    with open(os.path.join(ROOT, "CHANGELOG.md")) as f:
        assert f"## {rlcomm.__version__}" in f.read()
    try:
        installed = importlib.metadata.version("rlcomm")
    except importlib.metadata.PackageNotFoundError:
        return
    assert installed == rlcomm.__version__


def _type_checking_imports() -> dict[str, str]:
    """``name -> module`` of the imports under ``if TYPE_CHECKING:`` in rlcomm/__init__.py
    (what type checkers and the API reference read)."""
    with open(os.path.join(ROOT, "rlcomm", "__init__.py")) as f:
        tree = ast.parse(f.read())
    [block] = [n for n in tree.body if isinstance(n, ast.If)
               and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"]
    return {a.asname or a.name: node.module for node in block.body
            if isinstance(node, ast.ImportFrom) for a in node.names}


def test_every_public_name_is_imported_on_first_use():
    """``__all__``, the names imported for type checkers and the names imported on first
    use are the same, and each is the object its module defines."""
    assert _type_checking_imports() == rlcomm._MODULE_OF
    assert sorted(rlcomm.__all__) == sorted([*rlcomm._MODULE_OF, "__version__"])
    for name, module in rlcomm._MODULE_OF.items():
        assert getattr(rlcomm, name) is getattr(importlib.import_module(module), name), name
    assert set(rlcomm.__all__) <= set(dir(rlcomm))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        rlcomm.nothing  # noqa: B018


_STATUS_PATH = """
import os, sys
import rlcomm.__main__
from rlcomm.comm import status
from rlcomm.errors import RlcommError
try:  # imports what it needs, then finds no Ray to attach to
    status.job_status(endpoints={}, secret=b"")
except RlcommError:
    pass
else:
    raise AssertionError("job_status attached to a Ray")
assert "ray" in sys.modules
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("rlcomm"))
"""


def test_the_status_command_imports_no_torch():
    """``python -m rlcomm status`` imports what ``job_status`` needs (the registry, the
    store's client, Ray), but not torch, which takes longer to import than the status
    takes to gather."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", _STATUS_PATH], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
