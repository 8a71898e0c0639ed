"""How worker groups and their Ray actors are named.

A group name is a non-empty str without ``:``; the Ray actor of rank ``r`` of group ``g``
is named ``g:r`` in rlcomm's namespace. The worker, channel and controller layers all
find actors by these names, so the rule lives here, below them.
"""

from __future__ import annotations


def actor_name(group_name: str, rank: int) -> str:
    """The Ray actor name of rank ``rank`` of group ``group_name``."""
    return f"{group_name}:{rank}"


def check_group_name(name: object, where: str) -> None:
    """Raise unless ``name`` can name a worker group: a non-empty str without ``:``
    (``:`` separates group and rank in addresses such as ``actors:0``)."""
    if not isinstance(name, str):
        raise TypeError(f"{where}: a group name must be a str, got {type(name).__name__} {name!r}")
    if not name or name != name.strip():
        raise ValueError(f"{where}: a group name must be non-empty, without surrounding "
                         f"spaces; got {name!r}")
    if ":" in name:
        raise ValueError(f"{where}: group name {name!r} contains ':', which separates group "
                         "and rank in worker addresses (e.g. 'actors:0'); use '_' or '-' instead")
