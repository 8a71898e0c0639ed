"""Every method the docs call on a group is a method that group has.

Reads the Python blocks of the README and of every page (run or skipped alike: a skipped
block is still what a reader copies), finds the groups a page launches
(``name = SomeWorker.create_group(...).launch(...)``) and each call made on them
(``name.method(...)``, ``name.execute_on(...).method(...)``), and checks the method
against the group's methods: those of ``WorkerGroup`` and the group methods of the
page's worker class (the public methods it adds, and ``gpu_info``). No Ray.
"""

from __future__ import annotations

import ast
import glob
import os
import sys

import pytest

from rlcomm import Worker
from rlcomm.worker.actor import WORKER_GROUP_METHODS
from rlcomm.worker.group import WorkerGroup
from tests.test_examples import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))

import check_doc_blocks  # noqa: E402

PAGES = [os.path.join(ROOT, "README.md")] + sorted(
    glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
WORKER_OWN = set(dir(Worker))


def _page_code(path: str) -> ast.Module:
    """The page's Python blocks as one module. A skipped block may be a fragment (a
    class body, say) that does not parse alone: it is left out; one that runs must parse."""
    with open(path) as f:
        blocks = check_doc_blocks.parse(os.path.relpath(path, ROOT), f.read())
    body: list[ast.stmt] = []
    for block in blocks:
        if block.lang != "python":
            continue
        try:
            body += ast.parse(block.code).body
        except SyntaxError:
            if block.action == "run":
                raise
    return ast.Module(body=body, type_ignores=[])


def _classes(tree: ast.Module) -> dict[str, set[str]]:
    """Each class of the page, with the methods it defines or inherits from a class of
    the page."""
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    out: dict[str, set[str]] = {}

    def methods(name: str) -> set[str]:
        if name not in out:
            node = defs[name]
            own = {f.name for f in node.body
                   if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
            for base in node.bases:
                if isinstance(base, ast.Name) and base.id in defs:
                    own |= methods(base.id)
            out[name] = own
        return out[name]

    for name in defs:
        methods(name)
    return out


def _launched(tree: ast.Module) -> dict[str, str]:
    """``group variable -> worker class`` for ``g = Cls.create_group(...).launch(...)``."""
    groups = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            continue
        call = node.value
        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "launch" and isinstance(call.func.value, ast.Call)):
            made = call.func.value.func
            if (isinstance(made, ast.Attribute) and made.attr == "create_group"
                    and isinstance(made.value, ast.Name)):
                groups[node.targets[0].id] = made.value.id
    return groups


def _group_calls(tree: ast.Module, groups: dict[str, str]) -> list[tuple[str, str, int]]:
    """``(group variable, method, line)`` for each method called on a launched group."""
    calls = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Attribute)
                and owner.func.attr == "execute_on"):
            owner = owner.func.value
        if isinstance(owner, ast.Name) and owner.id in groups:
            calls.append((owner.id, node.func.attr, node.lineno))
    return calls


def _group_has(cls_methods: set[str], method: str) -> bool:
    if hasattr(WorkerGroup, method):
        return True
    if method in WORKER_GROUP_METHODS:
        return True
    return not method.startswith("_") and method in cls_methods and method not in WORKER_OWN


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_group_call_in_the_docs_is_a_group_method(page):
    tree = _page_code(page)
    classes = _classes(tree)
    groups = {g: c for g, c in _launched(tree).items() if c in classes}
    wrong = [f"{g}.{m} (block line {line}; {groups[g]} has no such group method)"
             for g, m, line in _group_calls(tree, groups)
             if not _group_has(classes[groups[g]], m)]
    assert not wrong, wrong


def test_the_check_sees_group_calls_and_catches_a_wrong_one():
    tree = ast.parse(
        "class W(Worker):\n    def play(self):\n        pass\n"
        "g = W.create_group().launch(cluster, name='g')\n"
        "g.play().wait()\ng.execute_on(0).gpu_info()\ng.send(1, 'x', 0)\ng.shutdown()\n")
    classes = _classes(tree)
    groups = _launched(tree)
    assert groups == {"g": "W"}
    calls = [(m, _group_has(classes["W"], m)) for _, m, _ in _group_calls(tree, groups)]
    assert sorted(calls) == [("execute_on", True), ("gpu_info", True), ("play", True),
                             ("send", False), ("shutdown", True)]
