"""The record a run keeps of its own checkpoints: their names, oldest first, and the timestamp each
was saved at. Every checkpoint holds the part of it that rotation keeps (see
:func:`lockstep.checkpoint.payload.build`), so a resumed run goes on rotating what it saved before."""

from __future__ import annotations

from typing import Any

from lockstep.checkpoint.layout import LOCAL


class SaveRecord:
    """This run's checkpoints in one save folder, as one rank knows them.

    ``keep`` is ``save_num_checkpoints_to_keep`` (-1: all); ``layout`` the checkpoint layout.
    """

    def __init__(self, keep: int, layout: str) -> None:
        self.keep, self.layout = keep, layout
        self.history: list[str] = []
        """Names (relative to the folder) of the published checkpoints, oldest first."""
        self.saved_at: dict[str, Any] = {}
        """The timestamp state each checkpoint was saved at (published or not yet)."""
        self.changes = 0
        """Counts the changes (a save, its publish, a rotation, a resume), for readers that poll."""

    def resumed(self, history: list[str], saved_at: dict[str, Any]) -> None:
        """Continue the record of the checkpoint the run resumed from."""
        self.history = list(history)
        self.saved_at.update(saved_at)
        self.changes += 1

    def saving(self, name: str, timestamp: Any) -> list[str]:
        """A save of ``name`` begins: the history once it is published."""
        self.saved_at[name] = timestamp
        self.changes += 1
        return [n for n in self.history if n != name] + [name]

    def published(self, history: list[str]) -> None:
        """The save :meth:`saving` returned ``history`` for is durable and visible."""
        self.history = history
        self.changes += 1

    def oldest_beyond_keep(self) -> str | None:
        """The oldest checkpoint rotation deletes next (None: nothing beyond ``keep``)."""
        return self.history[0] if self.keep != -1 and len(self.history) > self.keep else None

    def forget_oldest(self) -> None:
        """The checkpoint :meth:`oldest_beyond_keep` named is deleted."""
        self.history.pop(0)
        self.changes += 1

    def kept(self, history: list[str]) -> list[tuple[str, Any]]:
        """``(name, timestamp state)`` of the checkpoints of ``history`` that rotation keeps once
        the newest is published (per-rank files keep one more until every rank has published,
        which the loader may step back to)."""
        if self.keep != -1 and self.layout != LOCAL:
            history = history[len(history) - self.keep:]
        return [(name, self.saved_at.get(name)) for name in history]

    def entries(self, writes: bool) -> list[tuple[str, Any]]:
        """``(name, timestamp state)`` of each checkpoint this run saved that the folder still
        holds, oldest first (a rank that publishes no files lists all it took part in)."""
        return self.kept(self.history) if writes else list(self.saved_at.items())
