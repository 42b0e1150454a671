"""The episode id scheme, in one place: ids are deterministic from the plan, so the ledger, the
shards and checkpoints name the same sample the same way in synchronous and async runs.

    group   {task}/i{iteration}/g{group}           e.g. "lake/i3/g1"
    sample  {group id}/m{member}                   e.g. "lake/i3/g1/m0"
    eval    {tag}/{task}/{index}                   held-out episodes: one per "group"

Parsing reads from the right, so a task name may itself contain "/".
"""

from __future__ import annotations


def group_id(task: str, iteration: int, group: int) -> str:
    return f"{task}/i{iteration}/g{group}"


def sample_id(group: str, member: int) -> str:
    """The id of member `member` of the group whose id is `group`."""
    return f"{group}/m{member}"


def eval_id(tag: str, task: str, index: int) -> str:
    return f"{tag}/{task}/{index}"


def parse_sample_id(sid: str) -> tuple[str, int]:
    """sample id -> (group id, member)."""
    group, sep, member = sid.rpartition("/m")
    if not sep or not member.isdigit():
        raise ValueError(f"not a sample id: {sid!r} (expected '{{group id}}/m{{member}}')")
    return group, int(member)


def parse_group_id(gid: str) -> tuple[str, int, int]:
    """group id -> (task, iteration, group)."""
    head, sep, group = gid.rpartition("/g")
    task, sep2, iteration = head.rpartition("/i")
    if not (sep and sep2 and group.isdigit() and iteration.isdigit()):
        raise ValueError(f"not a group id: {gid!r} (expected '{{task}}/i{{iteration}}/g{{group}}')")
    return task, int(iteration), int(group)


def group_of_sample(sid: str) -> str:
    """The group id of a sample id."""
    return parse_sample_id(sid)[0]
