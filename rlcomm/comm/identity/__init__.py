"""Who is who: worker addresses, the endpoint registry, group and actor naming.

This package sits below every user of the comm layer (workers, channels, controllers),
so that ``rlcomm.comm`` never has to import from them.
"""

from rlcomm.comm.identity.address import RankLike, WorkerAddress, normalize_rank
from rlcomm.comm.identity.naming import actor_name, check_group_name
from rlcomm.comm.identity.registry import job_secret, registry

__all__ = ["RankLike", "WorkerAddress", "actor_name", "check_group_name", "job_secret",
           "normalize_rank", "registry"]
