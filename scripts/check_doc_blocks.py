#!/usr/bin/env python
"""Run the code blocks of the README and the docs, so that what they show stays true.

Every fenced block tagged ``python``, ``bash`` or ``sh`` in ``README.md`` and
``docs/**/*.md`` (the API pages under ``docs/api/`` hold no code) runs, or says why not
with a marker on the line before it:

    <!-- docs-check: skip: REASON -->                 not run, and why
    <!-- docs-check: instead: COMMAND | REASON -->     run COMMAND (bash) in its place

The blocks of one page run in order in one Python process, as the cells of a notebook:
a later block sees the names an earlier one made. Python blocks run in that process's
``__main__``; bash blocks run with ``bash -euo pipefail`` from the repository root.
Every page's process attaches to one Ray that this script starts (and ends) for all of
them, so Ray starts once; the next page starts only once the previous page's named
actors are gone. A block fails the check by raising or exiting non-zero; it is not
checked for what it prints.

    python scripts/check_doc_blocks.py                 # every page
    python scripts/check_doc_blocks.py docs/channels.md README.md
    python scripts/check_doc_blocks.py --list          # what would run, and the skips
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_LANGS = {"python": "python", "py": "python", "bash": "bash", "sh": "bash"}
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>[^`\n]*)$")
MARKER = re.compile(r"^<!--\s*docs-check:\s*(?P<kind>\w+):\s*(?P<rest>.*?)\s*-->$")
PAGE_TIMEOUT_S = 600.0
ACTORS_GONE_S = 120.0


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str  # python | bash
    code: str
    action: str  # run | skip | instead
    reason: str = ""
    command: str = ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


class MarkerError(ValueError):
    """A marker that does not say what to do, or why."""


def parse(page: str, text: str) -> list[Block]:
    """The fenced code blocks of one page that the check concerns, with their markers."""
    lines = text.split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group("fence"), m.group("info").strip()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        lang = RUN_LANGS.get(info.split()[0].lower() if info else "")
        if lang is not None:
            indent = len(m.group("indent"))
            code = "\n".join(ln[indent:] for ln in lines[i + 1:end]) + "\n"
            blocks.append(_with_marker(Block(page, i + 1, lang, code, "run"), lines, i))
        i = end + 1
    return blocks


def _with_marker(block: Block, lines: list[str], fence_at: int) -> Block:
    j = fence_at - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    if j < 0 or "docs-check" not in lines[j]:
        return block
    m = MARKER.match(lines[j].strip())
    if not m:
        raise MarkerError(f"{block.page}:{j + 1}: a docs-check marker must read "
                          "'<!-- docs-check: skip: REASON -->' or "
                          "'<!-- docs-check: instead: COMMAND | REASON -->'")
    kind, rest = m.group("kind"), m.group("rest")
    if kind == "skip":
        if not rest:
            raise MarkerError(f"{block.page}:{j + 1}: 'skip' needs a reason")
        block.action, block.reason = "skip", rest
    elif kind == "instead":
        command, _, reason = rest.partition("|")
        if not command.strip() or not reason.strip():
            raise MarkerError(f"{block.page}:{j + 1}: 'instead' needs a command and a reason")
        block.action, block.command, block.reason = "instead", command.strip(), reason.strip()
    else:
        raise MarkerError(f"{block.page}:{j + 1}: unknown docs-check marker {kind!r}")
    return block


def pages(selected: list[str]) -> list[str]:
    if selected:
        return [os.path.relpath(os.path.abspath(p), ROOT) for p in selected]
    found = ["README.md"] + sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                    recursive=True))
    return [p for p in found if not p.startswith(os.path.join("docs", "api") + os.sep)]


# -- the child: one page's blocks in one process --------------------------------------------


def run_page_blocks(blocks: list[Block]) -> int:
    """Run one page's blocks in order (in this process); the exit status."""
    import traceback

    import __main__

    namespace = __main__.__dict__
    for block in blocks:
        started = time.monotonic()
        print(f"[docs-check] {block.where} ({block.lang}) ...", flush=True)
        try:
            if block.action == "instead":
                _bash(block.command, block.where)
            elif block.lang == "bash":
                _bash(block.code, block.where)
            else:
                exec(compile(block.code, block.where, "exec"), namespace)
        except BaseException:  # noqa: BLE001 - reported, then the page fails
            traceback.print_exc()
            print(f"[docs-check] FAILED {block.where}", flush=True)
            return 1
        print(f"[docs-check] ok {block.where} ({time.monotonic() - started:.1f} s)", flush=True)
    return 0


def _bash(code: str, where: str) -> None:
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{where}: the bash block exited {proc.returncode}")


# -- the parent: one Ray, one process per page ---------------------------------------------


def _named_actors() -> set[tuple[str, str]]:
    import ray

    return {(a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)}


def _wait_actors_gone(baseline: set[tuple[str, str]], page: str) -> None:
    deadline = time.monotonic() + ACTORS_GONE_S
    while True:
        left = _named_actors() - baseline
        if not left:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"[docs-check] the actors of {page} outlived it by "
                             f"{ACTORS_GONE_S:.0f} s: {sorted(left)}")
        time.sleep(0.2)  # polling Ray's state for the actors to be gone, not hoping


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", help="pages to check (default: all)")
    parser.add_argument("--list", action="store_true", help="show the blocks; run nothing")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return run_page_blocks([Block(**b) for b in json.load(sys.stdin)])

    todo: dict[str, list[Block]] = {}
    skipped: list[Block] = []
    try:
        for page in pages(args.pages):
            with open(os.path.join(ROOT, page)) as f:
                for block in parse(page, f.read()):
                    if block.action == "skip":
                        skipped.append(block)
                    else:
                        todo.setdefault(page, []).append(block)
    except MarkerError as exc:
        print(f"[docs-check] {exc}", file=sys.stderr)
        return 2
    for block in skipped:
        print(f"[docs-check] skip {block.where}: {block.reason}")
    if args.list:
        for blocks in todo.values():
            for b in blocks:
                what = f"instead: {b.command} ({b.reason})" if b.action == "instead" else "run"
                print(f"[docs-check] {b.where} {b.lang}: {what}")
        return 0

    import ray

    start = time.monotonic()
    ray.init(address="local", include_dashboard=False, logging_level="ERROR", num_cpus=2)
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address,
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               RAY_USAGE_STATS_ENABLED="0")
    env["PATH"] = os.pathsep.join((os.path.dirname(sys.executable), env.get("PATH", "")))
    failed: list[str] = []
    ran = 0
    try:
        baseline = _named_actors()
        for page, blocks in todo.items():
            t0 = time.monotonic()
            payload = json.dumps([asdict(b) for b in blocks])
            try:
                proc = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--child"], input=payload,
                    text=True, cwd=ROOT, env=env, timeout=PAGE_TIMEOUT_S)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                print(f"[docs-check] {page}: past {PAGE_TIMEOUT_S:.0f} s", flush=True)
                code = 124
            if code:
                failed.append(page)
            else:
                ran += len(blocks)
            print(f"[docs-check] {page}: {'FAILED' if code else 'ok'}, {len(blocks)} blocks, "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
            _wait_actors_gone(baseline, page)
    finally:
        ray.shutdown()
    print(f"[docs-check] {ran} blocks ran, {len(skipped)} skipped with a reason, "
          f"{len(failed)} pages failed, {time.monotonic() - start:.0f} s", flush=True)
    if failed:
        print(f"[docs-check] failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
