"""Where the keys of a distributed channel live.

A distributed channel runs one channel worker per node (rank ``r`` on node ``r``). The
routing rule:

- Every key lives on exactly one channel worker, its *home*, for the channel's
  lifetime, so all items of a key are in one queue and stay FIFO.
- The home of a key is the channel worker on the node of the first client process that
  puts or gets that key (node 0's worker when no channel worker runs on that node).
- The node-0 channel worker (the *coordinator*) records the homes. A client process asks
  it once per key (one rlcomm request) and caches the answer; later calls go straight
  to the home. ``qsize`` / ``empty`` / ``full`` of a key no one has put or got yet
  report an empty key without choosing a home.

So a producer and a consumer of a key that run on one node only ever talk to that
node's channel worker, and the items never leave the node. Keys used from several nodes
cost a cross-node hop for every client not on the key's home node; when keys are spread
at random over nodes, a non-distributed channel is simpler and no slower.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from rlcomm.channel.protocol import Key


class HomeTable:
    """The coordinator's record of key homes. Thread-safe."""

    def __init__(self) -> None:
        self._homes: dict[Key, int] = {}
        self._lock = threading.Lock()

    def home(self, key: Key, proposed: int) -> int:
        """The home rank of ``key``; ``proposed`` becomes it if there is none and
        ``proposed >= 0``; ``-1`` if the key has none and ``proposed`` is negative."""
        with self._lock:
            rank = self._homes.get(key)
            if rank is None and proposed >= 0:
                rank = self._homes[key] = proposed
            return -1 if rank is None else rank

    def snapshot(self) -> dict[Key, int]:
        with self._lock:
            return dict(self._homes)


class RouteCache:
    """A client process's cached key homes for one distributed channel.

    Args:
        node_ids: the Ray node id of each channel worker, by rank.
        my_node_id: this process's Ray node id.
    """

    def __init__(self, node_ids: Sequence[str], my_node_id: str):
        ids = list(node_ids)
        #: The rank this process proposes as a new key's home: its own node's worker.
        self.local_rank = ids.index(my_node_id) if my_node_id in ids else 0
        self._homes: dict[Key, int] = {}

    def get(self, key: Key) -> int | None:
        return self._homes.get(key)

    def remember(self, key: Key, rank: int) -> None:
        self._homes[key] = rank
