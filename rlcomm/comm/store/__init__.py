"""The authenticated store: every worker's mailbox and its peers' rendezvous keys. The
wire format and the handshake's MAC (:mod:`.wire`), the client's connection (:mod:`.link`,
no torch: ``python -m rlcomm status`` uses it alone), the ``torch.distributed.Store``
interface over it (:mod:`.client`), the server (:mod:`.server`, :mod:`.session`), and
the mailbox with its notes (:mod:`.rendezvous`).

Nothing is imported here, so that importing :mod:`.link` imports no torch."""
