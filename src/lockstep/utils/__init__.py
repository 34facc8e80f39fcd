"""Composer's ``composer.utils``: ``dist`` (the same module as :mod:`lockstep.dist`, also importable
as ``lockstep.utils.dist``), ``reproducibility``, ``get_device``, the object stores (also importable
as ``lockstep.utils.object_store``) and small helpers."""

import sys

from lockstep import dist, objectstore
from lockstep.utils import reproducibility
from lockstep.utils.device import get_device
from lockstep.utils.misc import ensure_tuple, get_free_tcp_port, is_model_fsdp, map_collection, model_eval_mode
from lockstep.core.types import StringEnum
from lockstep.utils.names import format_name_with_dist, format_name_with_dist_and_time, partial_format
from lockstep.utils.reproducibility import configure_deterministic_mode, get_random_seed, seed_all
from lockstep.objectstore import ObjectStore, ObjectStoreTransientError, S3ObjectStore, parse_uri

# ``import lockstep.utils.dist`` finds the one dist module: one implementation, two names
sys.modules[f"{__name__}.dist"] = dist
sys.modules[f"{__name__}.object_store"] = objectstore

__all__ = ["ObjectStore", "ObjectStoreTransientError", "S3ObjectStore", "StringEnum", "configure_deterministic_mode",
           "dist", "ensure_tuple", "format_name_with_dist", "format_name_with_dist_and_time", "get_device",
           "get_free_tcp_port", "get_random_seed", "is_model_fsdp", "map_collection", "model_eval_mode", "parse_uri",
           "partial_format", "reproducibility", "seed_all"]
