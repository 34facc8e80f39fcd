"""Composer's module path of :class:`~lockstep.loggers.console.ConsoleLogger`."""

from lockstep.loggers.console import ConsoleLogger

__all__ = ["ConsoleLogger"]
