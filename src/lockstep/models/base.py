"""``ComposerModel`` at Composer's ``composer.models.base`` path: it is :class:`lockstep.Model`."""

from lockstep.model import Model as ComposerModel

__all__ = ["ComposerModel"]
