"""Composer's ``composer.utils``: ``dist`` (the same module as :mod:`lockstep.dist`, also importable
as ``lockstep.utils.dist``), ``reproducibility``, ``get_device``, the object stores (also importable
as ``lockstep.utils.object_store``) and small helpers."""

import sys

from lockstep import dist, objectstore
from lockstep.batch import batch_get, batch_set
from lockstep.utils import compression, reproducibility
from lockstep.utils.compression import KNOWN_COMPRESSORS, CliCompressor, get_compressor, is_compressed_pt
from lockstep.utils.file_helpers import get_file, is_tar
from lockstep.utils.hparams import (
    convert_flat_dict_to_nested_dict, convert_nested_dict_to_flat_dict, extract_hparams)
from lockstep.utils.interval import create_interval_scheduler
from lockstep.utils.device import get_device
from lockstep.utils.misc import ensure_tuple, get_free_tcp_port, is_model_fsdp, map_collection, model_eval_mode
from lockstep.core.types import StringEnum
from lockstep.utils.names import format_name_with_dist, format_name_with_dist_and_time, partial_format
from lockstep.utils.reproducibility import configure_deterministic_mode, get_random_seed, seed_all
from lockstep.objectstore import GCSObjectStore, ObjectStore, ObjectStoreTransientError, S3ObjectStore, parse_uri

# ``import lockstep.utils.dist`` finds the one dist module: one implementation, two names
sys.modules[f"{__name__}.dist"] = dist
sys.modules[f"{__name__}.object_store"] = objectstore

__all__ = ["KNOWN_COMPRESSORS", "CliCompressor", "GCSObjectStore", "ObjectStore", "ObjectStoreTransientError",
           "S3ObjectStore",
           "StringEnum", "batch_get", "batch_set", "compression", "configure_deterministic_mode",
           "convert_flat_dict_to_nested_dict", "convert_nested_dict_to_flat_dict", "create_interval_scheduler",
           "dist", "ensure_tuple", "extract_hparams", "format_name_with_dist", "format_name_with_dist_and_time",
           "get_compressor", "get_device", "get_file", "is_compressed_pt", "is_tar",
           "get_free_tcp_port", "get_random_seed", "is_model_fsdp", "map_collection", "model_eval_mode", "parse_uri",
           "partial_format", "reproducibility", "seed_all"]
