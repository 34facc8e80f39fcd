"""How many ranks this launcher can hold open: its open-file limit, checked before anything starts.

The launcher keeps a few descriptors per rank for the whole run: the rank's log files, a pidfd, its
progress slot (a mapped file keeps its own descriptor) and a pipe per stream it copies (``--tee``, or
local rank 0's console on several nodes). Where it hosts the c10d store, every rank's connection
to it is one more. A launcher that runs out fails midway, after creating thousands of log files, so
the count is checked against ``RLIMIT_NOFILE`` up front.
"""

from __future__ import annotations

import resource

from lockstep.launcher.plan import LaunchError, LaunchPlan, Mode, RankSpec, Stream

_RESERVE = 64  # the launcher's own: standard streams, signal and watchdog pipes, epoll, spawning
_LEAST_PER_RANK = 2  # its pidfd and its progress slot


def check_open_files(plan: LaunchPlan, limits: tuple[int, int] | None = None) -> None:
    """Refuse a plan whose ranks need more open files than the launcher may open.

    ``limits``: (soft, hard) RLIMIT_NOFILE, this process's own when None."""
    soft, hard = limits or resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    need = _fixed(plan) + _LEAST_PER_RANK * plan.nproc
    if need <= soft:  # else refused without going through every rank (-n 100000 would take seconds)
        need = open_files_needed(plan)
    if need <= soft:
        return
    if hard == resource.RLIM_INFINITY or need <= hard:
        fix = f"lower -n, or raise the limit with ulimit -n {need} before starting lockstep"
    else:
        fix = f"lower -n: even the hard limit (ulimit -Hn) is {hard}"
    raise LaunchError(f"-n {plan.nproc} needs about {need} open files in the launcher, more than its "
                      f"limit of {soft} (ulimit -n): {fix}")


def open_files_needed(plan: LaunchPlan) -> int:
    """The descriptors the launcher holds at once while every rank of ``plan`` runs."""
    return _fixed(plan) + sum(_per_rank(spec, plan.is_multinode) for spec in plan.ranks)


def _fixed(plan: LaunchPlan) -> int:
    if plan.hosts_store and (plan.mode is Mode.COMMAND or plan.is_multinode):
        return _RESERVE + plan.world_size + 2 * plan.group_world_size  # the ranks' and launchers' clients
    return _RESERVE


def _per_rank(spec: RankSpec, multinode: bool) -> int:
    logs = len({p for p in (spec.stdout_path, spec.stderr_path) if p is not None})
    piped = spec.tee
    if multinode and spec.local_rank == 0:
        piped |= Stream.BOTH  # at most: a console that is a terminal stays unpiped
    return logs + int(piped).bit_count() + _LEAST_PER_RANK
