"""The training loop and its parts; ``lockstep.trainer.Trainer`` is Composer's path to the Trainer."""

from lockstep.trainer.trainer import Trainer

__all__ = ["Trainer"]
