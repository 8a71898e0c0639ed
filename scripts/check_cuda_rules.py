"""Check that the CPU tests catch every ordering rule of the CUDA paths.

Each rule is one line (or a few) of the CUDA IPC protocol: a stream waiting for another,
an event recorded, memory kept from reuse. For each, this script removes the rule from a
copy of the package, runs the test that stands for it on the fake device layer
(``tests/comm/fake_device.py``: asynchronous streams, a caching allocator) and expects it
to fail. It prints one row per rule and exits non-zero if a test still passes without its
rule, or if a test fails with every rule in place.

    .venv/bin/python scripts/check_cuda_rules.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IPC = "rlcomm/comm/transports/cuda_ipc.py"
PAYLOAD = "rlcomm/comm/connection/payload.py"
ORDERING = "tests/comm/test_cuda_ordering.py"
PROTOCOL = "tests/comm/test_cuda_ipc.py"
PUSH = "rlcomm/comm/transports/cuda_push.py"
PUSHED = "tests/comm/test_cuda_push.py"


@dataclass(frozen=True)
class Rule:
    what: str
    path: str
    line: str  # the rule as it stands in the code (must occur once)
    without: str  # what stands there without it
    test: str  # the test that fails without it (file::name[id])


_COPY_OUT_WAIT = (
    "        ops.wait_stream(stream, order if order is not None else ops.current_stream(\n"
    "            into[0].device if into else device or src_device), self._recv_mark)\n"
)

RULES = [
    Rule("the staging copy waits for the caller's order (its writes to the payload)", IPC,
         "            ops.wait_stream(self._send_stream, order, self._send_mark)\n", "",
         f"{ORDERING}::test_the_staging_copy_reads_the_payload_after_the_callers_writes"),
    Rule("a staging copy waits for the receiver's done (its copy out of the slot)", IPC,
         "                ops.wait_event(self._send_stream, self._peer_done)\n", "",
         f"{ORDERING}::test_a_slot_is_written_again_after_the_receiver_copied_its_last_message"),
    Rule("the caller's tensors are kept from reuse until the staging copy read them", IPC,
         "                ops.keep_until_done(pieces, self._send_stream)\n", "",
         f"{ORDERING}::test_a_payload_freed_after_an_async_send_is_not_reused_before_the_staging_copy"),
    Rule("ready is recorded after the staging copy", IPC,
         "            ops.record(self._ready, self._send_stream)\n", "",
         f"{ORDERING}::test_the_receiver_copies_a_staged_payload_after_it_is_in_the_slot"),
    Rule("the receiver's copy waits for the sender's ready", IPC,
         "        ops.wait_event(stream, self._peer_ready)  # the sender's bytes are there\n", "",
         f"{ORDERING}::test_the_receiver_copies_a_staged_payload_after_it_is_in_the_slot"),
    Rule("a staged send: the caller's stream waits for ready", IPC,
         "                self._ops.wait_event(order, self._ready)\n", "                pass\n",
         f"{ORDERING}::test_the_caller_writes_a_staged_payload_again_after_the_staging_copy[stream]"),
    Rule("a staged async send: the host waits for ready", IPC,
         "                self._ops.synchronize(self._ready)\n", "                pass\n",
         f"{ORDERING}::test_the_caller_writes_a_staged_payload_again_after_the_staging_copy[host]"),
    Rule("a lent send: the caller's stream waits for the receiver's done", IPC,
         "            self._ops.wait_event(order, read)\n", "            pass\n",
         f"{ORDERING}::test_the_caller_writes_a_lent_payload_again_after_the_receivers_copy[stream]"),
    Rule("a lent async send: the host waits for the receiver's done", IPC,
         "            self._ops.synchronize(read)\n", "            pass\n",
         f"{ORDERING}::test_the_caller_writes_a_lent_payload_again_after_the_receivers_copy[host]"),
    Rule("the receiver's copy waits for the caller's order (its buffers are free)", IPC,
         _COPY_OUT_WAIT, "",
         f"{ORDERING}::test_the_receivers_copy_waits_for_the_callers_work_on_its_buffers"),
    Rule("a copy without an order waits for the current stream its new memory comes from",
         IPC, _COPY_OUT_WAIT, "        ops.wait_stream(stream, order, self._recv_mark)\n",
         f"{ORDERING}::test_a_copy_taken_in_before_any_receive_waits_for_the_current_streams_kernels"),
    Rule("done is recorded after the receiver's copy", IPC,
         "        ops.record(self._done, stream)\n", "",
         f"{ORDERING}::test_the_caller_reads_what_it_received_after_the_copy[staged]"),
    Rule("a receive's new memory is kept from reuse until its copy is done", IPC,
         "            ops.keep_until_done([block], stream)\n", "            pass\n",
         f"{ORDERING}::test_new_memory_of_a_receive_is_not_reused_before_its_copy"),
    Rule("the receiving caller's stream waits for done", IPC,
         "            ops.wait_event(order, self._done)\n", "            pass\n",
         f"{ORDERING}::test_the_caller_reads_what_it_received_after_the_copy[lent]"),
    Rule("a receive op orders its stream after a copy taken in before it", PAYLOAD,
         "                ipc.order_after(ipc.current_order(at))\n", "                pass\n",
         f"{PROTOCOL}::test_a_receive_op_orders_its_stream_after_a_copy_taken_in_earlier"),
    Rule("ordering after the copies taken in waits for done (their last record)", IPC,
         "        self._ops.wait_event(order, self._done)\n", "        pass\n",
         f"{PROTOCOL}::test_a_receive_op_orders_its_stream_after_a_copy_taken_in_earlier"),
    Rule("a receiver asking for a write orders its receive stream after the caller's work",
         IPC, "        ops.wait_stream(stream, order, self._recv_mark)\n", "",
         f"{ORDERING}::test_the_sender_writes_registered_tensors_after_the_receivers_reads"),
    Rule("a receiver asking for a write records done after it", IPC,
         "        ops.record(self._done, stream)  # what the sender's write waits for\n", "",
         f"{ORDERING}::test_the_sender_writes_registered_tensors_after_the_receivers_reads"),
    Rule("a sender's write into registered tensors waits for the receiver's done", IPC,
         "            # The receiver's reads of its tensors are done (it recorded done after them).\n"
         "            ops.wait_event(self._send_stream, self._peer_done)\n",
         "            # The receiver's reads of its tensors are done (it recorded done after them).\n",
         f"{ORDERING}::test_the_sender_writes_registered_tensors_after_the_receivers_reads"),
    Rule("a sender's write into registered tensors records ready after its copy", IPC,
         "            ops.record(self._ready, self._send_stream)  # the receiver's stream waits for it\n",
         "",
         f"{ORDERING}::test_the_receiver_reads_registered_tensors_after_the_senders_write"),
    Rule("a receiver whose tensors were written orders its stream after the sender's ready",
         IPC, "        ops.wait_event(order, self._peer_ready)  # the sender's copy is done first\n",
         "", f"{ORDERING}::test_the_receiver_reads_registered_tensors_after_the_senders_write"),
    Rule("a send written into registered tensors: the caller's stream waits for its own ready",
         IPC, "        read = self._ready if outgoing.pushed else self._peer_done\n",
         "        read = self._peer_done\n",
         f"{ORDERING}::test_the_caller_writes_a_payload_it_wrote_into_the_receiver_again_after_that_write[stream]"),
    Rule("a send written into registered tensors, async: the host waits for its own ready",
         IPC, "        read = self._ready if outgoing.pushed else self._peer_done\n",
         "        read = self._peer_done\n",
         f"{ORDERING}::test_the_caller_writes_a_payload_it_wrote_into_the_receiver_again_after_that_write[host]"),
    Rule("a registration records free after the receiver's work so far", PUSH,
         "    ops.record(free, order)  # the source's first copies come after the work queued so far\n",
         "", f"{PUSHED}::test_the_first_push_comes_after_the_receivers_own_writes_before_registering"),
    Rule("a push's copies wait for the caller's stream (the source's values)", PUSH,
         "            ops.wait_stream(self._stream, order, self._mark)  # the source's values are written\n",
         "", f"{PUSHED}::test_a_push_copies_the_sources_values_after_the_callers_writes"),
    Rule("a push's copies wait for each receiver's free", PUSH,
         "                ops.wait_event(self._stream, receiver.free)\n", "",
         f"{PUSHED}::test_a_push_writes_a_receivers_tensors_after_its_reads_of_the_last_version"),
    Rule("a push records ready after its copies", PUSH,
         "            ops.record(self._ready, self._stream)\n", "",
         f"{PUSHED}::test_an_update_orders_the_receivers_reads_after_the_copies"),
    Rule("a push orders the caller's stream after ready", PUSH,
         "            ops.wait_event(order, self._ready)  # later writes to the source come after\n",
         "", f"{PUSHED}::test_the_source_writes_its_tensors_again_after_the_push_read_them"),
    Rule("an update orders the receiver's stream after ready", PUSH,
         "            self._ops.wait_event(order, self._ready)  # the source's copies are done first\n",
         "", f"{PUSHED}::test_an_update_orders_the_receivers_reads_after_the_copies"),
    Rule("a release records free after the receiver's reads so far", PUSH,
         "        self._ops.record(self._free, order)\n", "",
         f"{PUSHED}::test_a_release_lets_the_source_write_only_after_the_reads_queued_before_it"),
]


def _pytest(tree: str, tests: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=tree)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
         *tests], cwd=tree, env=env, capture_output=True, text=True, timeout=300,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlcomm-rules-") as tmp:
        tree = os.path.join(tmp, "tree")
        shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(
            ".venv", ".git", "*.egg-info", "site", "docs", "examples", "__pycache__"))
        tests = sorted({r.test for r in RULES})
        whole = _pytest(tree, tests)
        if whole.returncode != 0:
            print(whole.stdout[-3000:])
            print("the rules' tests fail with every rule in place")
            return 1
        rows, caught_all = [], True
        for rule in RULES:
            path = os.path.join(tree, rule.path)
            with open(path) as f:
                source = f.read()
            if source.count(rule.line) != 1:
                print(f"{rule.path}: the rule {rule.what!r} is not in the code as written "
                      "here; update this script")
                return 1
            with open(path, "w") as f:
                f.write(source.replace(rule.line, rule.without))
            try:
                run = _pytest(tree, [rule.test])
            finally:
                with open(path, "w") as f:
                    f.write(source)
            caught = run.returncode == 1 and " failed" in run.stdout
            caught_all &= caught
            rows.append({"rule": rule.what, "test": rule.test.split("::")[1],
                         "caught": caught})
            print(f"{'caught' if caught else 'MISSED':7} {rule.what}\n        "
                  f"{rule.test.split('::')[1]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{sum(r['caught'] for r in rows)} of {len(rows)} rules caught")
    return 0 if caught_all else 1


if __name__ == "__main__":
    sys.exit(main())
