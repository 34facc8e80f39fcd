"""Composer's ``composer.utils``: ``dist`` (the same module as :mod:`lockstep.dist`, also importable
as ``lockstep.utils.dist``), ``reproducibility``, ``get_device`` and small helpers."""

import sys

from lockstep import dist
from lockstep.utils import reproducibility
from lockstep.utils.device import get_device
from lockstep.utils.misc import ensure_tuple, get_free_tcp_port, is_model_fsdp, map_collection, model_eval_mode
from lockstep.utils.reproducibility import configure_deterministic_mode, get_random_seed, seed_all

# ``import lockstep.utils.dist`` finds the one dist module: one implementation, two names
sys.modules[f"{__name__}.dist"] = dist

__all__ = ["configure_deterministic_mode", "dist", "ensure_tuple", "get_device", "get_free_tcp_port",
           "get_random_seed", "is_model_fsdp", "map_collection", "model_eval_mode", "reproducibility", "seed_all"]
