"""Ranks started again in place (``lockstep --rank_restarts K``): what a lost rank of an elastic job
is started again with, and how many times each rank was. The supervisor starts it; the master's
launcher lets it into the running job (:mod:`lockstep.launcher.membership`)."""

from __future__ import annotations

from typing import Any

from lockstep.launcher.elastic_names import JOIN_ENV, RESPAWN_ENV, START_ENV


class InPlace:
    """This launcher's starts of its lost ranks, up to ``limit`` per rank over the whole run."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.attempt = 0
        self.watchdog: Any = None
        self.waiter: Any = None
        """The monitor's waiter, which a rank started again is added to (the newest attempt's)."""
        self.tokens: dict[int, str] = {}
        """Each launch rank started again and not lost since: its request to join."""
        self._envs: dict[int, dict[str, str]] = {}
        self._used: dict[int, int] = {}

    def remember(self, attempt: int, envs: dict[int, dict[str, str]], watchdog: Any) -> None:
        """The attempt's number, each local rank's environment and the watchdog, as its ranks start."""
        self.attempt, self._envs, self.watchdog = attempt, {k: dict(v) for k, v in envs.items()}, watchdog

    def take(self, rank: int) -> int | None:
        """Which start of launch rank ``rank`` this is (from 1), or None when its starts are used up."""
        used = self._used.get(rank, 0)
        if used >= self.limit or self.waiter is None or self.watchdog is None:
            return None
        self._used[rank] = used + 1
        return used + 1

    def env(self, local_rank: int, token: str) -> dict[str, str]:
        """The environment the local rank started with, to enter the running job with request ``token``."""
        env = {k: v for k, v in self._envs[local_rank].items() if k not in ("LOCKSTEP_STORE_FD", START_ENV)}
        env[JOIN_ENV], env[RESPAWN_ENV] = token, "1"
        return env
