"""scripts/bench_multinode.py's tables, the figures the docs quote and the docs section
(scripts/make_tables.py renders them) from known records (the run itself needs root and
minutes: it is not a test)."""

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
    import make_tables

    result = _result()
    out = make_tables.multinode_tables(result)
    assert "| N (nodes) | 2 | 3 | 5 |" in out
    assert "| pipelined / bound | 1.00x | 1.05x | 1.16x |" in out
    assert "| Ray / pipelined | 1.05x | 2.00x | 4.00x |" in out
    assert "| pipelined, change from N - 1 | - | +5 % | +5 % |" in out
    assert "| rlcomm star (Gloo), N = 5 | 12.0 |" in out
    acc = make_tables.multinode_acceptance(result)
    assert acc["nodes"] == 5
    assert abs(acc["pipelined_over_bound"] - 2.2 / 1.9) < 1e-9
    assert abs(acc["pipelined_over_bound_all_rounds"] - 2.2 / 2.0) < 1e-9
    assert abs(acc["growth_per_node_max"] - (2.1 / 2.0 - 1)) < 1e-9
    assert abs(acc["ray_over_pipelined"] - 4.0) < 1e-9


def test_the_docs_section_quotes_the_run():
    import make_tables

    text = make_tables.multinode_section(_result())
    assert text.startswith("*One run of `scripts/bench_multinode.py`")
    assert "| N (nodes) | 2 | 3 | 5 |" in text
    assert "At 5 nodes the pipelined broadcast took 1.16x one node-to-node transfer" in text
    assert "grew by at most 5 %" in text
