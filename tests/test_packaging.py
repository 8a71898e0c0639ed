"""Package metadata: every third-party import is a declared dependency, and the files a
user looks for (LICENSE, CHANGELOG, version) exist. The wheel itself is built and
installed into a fresh venv by scripts/check_wheel (CI)."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
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
