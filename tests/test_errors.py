"""rlcomm.errors: communication errors carry the peer and the op as fields."""

import pickle

import pytest

from rlcomm import CommError, CommTimeoutError, PeerLostError, RlcommTimeoutError, WorkerAddress


@pytest.mark.parametrize("cls", [CommError, PeerLostError, CommTimeoutError])
def test_peer_and_op_are_fields_and_survive_pickling(cls):
    peer = WorkerAddress("trainer", 1)
    err = cls("recv from trainer:1 failed", peer=peer, op="recv")
    assert (err.peer, err.op, str(err)) == (peer, "recv", "recv from trainer:1 failed")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert (back.peer, back.op, str(back)) == (peer, "recv", str(err))


def test_old_style_construction_still_works():
    err = PeerLostError("the peer is gone")
    assert (err.peer, err.op, err.args) == (None, None, ("the peer is gone",))
    timeout = CommTimeoutError()
    assert isinstance(timeout, RlcommTimeoutError) and isinstance(timeout, TimeoutError)
    assert timeout.peer is None
