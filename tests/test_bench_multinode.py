"""scripts/bench_multinode.py: its tables, acceptance figures and docs section from known
records (the run itself needs root and minutes: it is not a test)."""

from __future__ import annotations

import os
import sys

from tests.test_examples import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))


def _result() -> dict:
    import bench_multinode as bm

    mib = 1 << 20

    def rec(sweep, way, nodes, median, **kw):
        return {"sweep": sweep, "way": way, "nodes": nodes, "median": median, "first": median,
                "min": median, "max": median, "samples": [median], **kw}

    records = []
    for n, (pipe, star, ray_t, bound) in {2: (2.0, 2.0, 2.1, 2.0), 3: (2.1, 4.0, 4.2, 2.0),
                                          5: (2.2, 6.0, 8.8, 1.9)}.items():
        for way, t in ((bm.PIPELINED, pipe), (bm.STAR, star), (bm.RAY, ray_t), (bm.BOUND, bound)):
            records.append(rec("nodes", way, n, t, bytes=256 * mib, chunk=mib))
    records += [rec("switch", bm.PIPELINED, 5, 0.005, bytes=mib, chunk=mib),
                rec("switch", bm.STAR, 5, 0.012, bytes=mib, chunk=mib),
                rec("chunk", bm.PIPELINED, 5, 2.3, bytes=256 * mib, chunk=4 * mib)]
    return {"records": records,
            "args": {"tensors": 16, "repeats": 3, "rate": "1gbit"},
            "host": {"cpus": 2, "python": "3.11", "load_before": "1.0", "load_after": "2.0"}}


def test_tables_and_acceptance_from_known_records():
    import bench_multinode as bm

    result = _result()
    out = bm.tables(result)
    assert "| N (nodes) | 2 | 3 | 5 |" in out
    assert "| pipelined / bound | 1.00x | 1.05x | 1.16x |" in out
    assert "| Ray / pipelined | 1.05x | 2.00x | 4.00x |" in out
    assert "| pipelined, change from N - 1 | - | +5 % | +5 % |" in out
    assert "| rlcomm star (Gloo), N = 5 | 12.0 |" in out
    acc = bm.acceptance(result)
    assert acc["nodes"] == 5
    assert abs(acc["pipelined_over_bound"] - 2.2 / 1.9) < 1e-9
    assert abs(acc["pipelined_over_bound_all_rounds"] - 2.2 / 2.0) < 1e-9
    assert abs(acc["growth_per_node_max"] - (2.1 / 2.0 - 1)) < 1e-9
    assert abs(acc["ray_over_pipelined"] - 4.0) < 1e-9


def test_docs_section_goes_between_its_markers(tmp_path):
    import bench_multinode as bm

    page = tmp_path / "multinode.md"
    page.write_text(f"# Multi-node\n\nhand-written\n\n{bm.MD_BEGIN}\nstale table\n{bm.MD_END}\n\ntail\n")
    bm.write_md(str(page), bm.md_section(_result(), "bench_multinode.png"))
    text = page.read_text()
    assert text.startswith("# Multi-node\n\nhand-written\n\n") and text.endswith("\n\ntail\n")
    assert "stale table" not in text and text.count(bm.MD_BEGIN) == 1
    assert "![time against N](bench_multinode.png)" in text
