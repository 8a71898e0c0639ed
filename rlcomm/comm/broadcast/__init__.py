"""Broadcast: one group per distinct ordered set of members (:mod:`.group`), the
pipelined chain of nodes (:mod:`.chain`), what each node takes of a streamed payload and
the routes there (:mod:`.routes`), a stream of buckets to one node's members
(:mod:`.stream`), Gloo's (NCCL's) broadcast between nodes (:mod:`.gloo`), and the copies
on a GPU (:mod:`.device`)."""
