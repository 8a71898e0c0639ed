"""The docs' tools: scripts/check_doc_blocks.py's markers, scripts/make_tables.py's
regions, and scripts/bench_loop.py's figures from known records. No Ray."""

from __future__ import annotations

import os
import sys

import pytest

from tests.test_examples import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))

import check_doc_blocks  # noqa: E402
import make_tables  # noqa: E402

PAGE = """\
# A page

```python
x = 1
```

<!-- docs-check: skip: needs a GPU -->
```python
import cupy
```

<!-- docs-check: instead: scripts/demo --help | the demo takes minutes -->
```bash
scripts/demo
```

```text
not code
```

    ```py
    y = x + 1
    ```
"""


def test_blocks_and_their_markers():
    blocks = check_doc_blocks.parse("page.md", PAGE)
    assert [(b.line, b.lang, b.action) for b in blocks] == [
        (3, "python", "run"), (8, "python", "skip"), (13, "bash", "instead"), (21, "python", "run")]
    assert blocks[1].reason == "needs a GPU"
    assert (blocks[2].command, blocks[2].reason) == ("scripts/demo --help", "the demo takes minutes")
    assert blocks[3].code == "y = x + 1\n"  # an indented block loses its indent


@pytest.mark.parametrize("marker", [
    "<!-- docs-check: skip: -->",  # no reason
    "<!-- docs-check: instead: scripts/demo -->",  # no reason
    "<!-- docs-check: maybe: later -->",  # no such marker
    "<!-- docs-check skip because -->",  # not the form
])
def test_a_marker_must_say_what_and_why(marker):
    with pytest.raises(check_doc_blocks.MarkerError):
        check_doc_blocks.parse("page.md", f"{marker}\n```python\npass\n```\n")


def test_every_docs_block_runs_or_says_why():
    """The real pages parse: every marker is well formed."""
    for page in check_doc_blocks.pages([]):
        with open(os.path.join(ROOT, page)) as f:
            check_doc_blocks.parse(page, f.read())


def test_the_quickstart_blocks_are_the_example_that_runs():
    """The README's and the getting-started page's first program is not run by the docs
    check: it is examples/quickstart.py, which the suite and the wheel check run."""
    with open(os.path.join(ROOT, "examples", "quickstart.py")) as f:
        example = f.read()
    skipped = []
    for page in ("README.md", "docs/getting-started.md"):
        with open(os.path.join(ROOT, page)) as f:
            blocks = check_doc_blocks.parse(page, f.read())
        skipped += [b for b in blocks if "examples/quickstart.py" in b.reason]
    assert len(skipped) == 2, [b.where for b in skipped]
    for block in skipped:
        assert block.action == "skip" and block.code in example, block.where


def test_regions_are_rewritten_and_hand_rows_kept(monkeypatch):
    monkeypatch.setitem(make_tables.RENDERERS, "demo", lambda: "| a |\n| --- |\n| 1 |")
    monkeypatch.setattr(make_tables, "measured_rows", lambda: [["Measured: x", "1", "2", "3", "4"]])
    text = ("before\n<!-- make_tables: demo -->\nstale\n<!-- /make_tables -->\n"
            "<!-- make_tables: readme-compare -->\n| | A |\n| --- | --- |\n| feature | yes |\n"
            "| Measured: old | 0 |\n<!-- /make_tables -->\nafter\n")
    out = make_tables.rewrite(text, "page.md")
    assert "stale" not in out and "| a |\n| --- |\n| 1 |\n<!-- /make_tables -->" in out
    assert "| feature | yes |\n| Measured: x | 1 | 2 | 3 | 4 |\n<!-- /make_tables -->" in out
    assert "Measured: old" not in out and out.startswith("before\n") and out.endswith("after\n")
    with pytest.raises(SystemExit, match="no renderer for region 'nope'"):
        make_tables.rewrite("<!-- make_tables: nope -->\n<!-- /make_tables -->", "page.md")


def test_loop_figures_from_records():
    import bench_loop

    # Five updates, one second apart, 100 steps each; the first is warm-up.
    records = [{"version": v, "start": float(v), "got": v + 0.1, "stepped": v + 0.5,
                "end": v + 0.6, "steps": 100, "sync_start": v + 0.5} for v in range(1, 6)]
    reports = [{"arrivals": {v: v + 0.52 for v in range(1, 6)}},
               {"arrivals": {v: v + 0.54 for v in range(1, 6)}}]
    s = bench_loop.summarize(records, reports, warmup=1)
    assert s["env_steps_per_s"] == pytest.approx(100.0)  # 300 steps over 3 s
    assert s["update_ms"] == pytest.approx(1000.0)
    assert s["weight_sync_ms"] == pytest.approx(40.0)  # the last worker's arrival
    assert s["step_ms"] == pytest.approx(400.0) and s["waiting_for_episodes_ms"] == pytest.approx(100.0)
    assert bench_loop.count_parameters(0) == sum(
        p.numel() for p in bench_loop.Policy(0).parameters())
    assert bench_loop.count_parameters(10) == sum(
        p.numel() for p in bench_loop.Policy(10).parameters())
