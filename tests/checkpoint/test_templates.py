"""Checkpoint name templates."""

from __future__ import annotations

import pytest

from lockstep.checkpoint import templates
from lockstep.checkpoint.templates import glob_of
from lockstep.time import Timestamp


def test_every_field_formats() -> None:
    place = {"run_name": "r", "rank": 1, "local_rank": 1, "world_size": 4, "local_world_size": 2,
             "node_rank": 0}
    ts = Timestamp(epoch=1, batch=4, sample=64, token=640)
    name = templates.format_name(
        "{run_name}/ep{epoch}-ba{batch:03d}-sp{sample}-tok{token}-r{rank}-l{local_rank}-w{world_size}"
        "-lw{local_world_size}-n{node_rank}.pt", place, ts)
    assert name == "r/ep1-ba004-sp64-tok640-r1-l1-w4-lw2-n0.pt"


def test_unknown_field_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['step'\]; valid fields: \{run_name\}"):
        templates.check_template("ba{step}.pt", "save_filename")


def test_folder_cannot_use_time_fields() -> None:
    with pytest.raises(ValueError, match=r"save_folder='ck/\{epoch\}' cannot use \['epoch'\]"):
        templates.check_template("ck/{epoch}", "save_folder", time_fields=False)
    assert templates.check_template("ck/{run_name}", "save_folder", time_fields=False)


def test_bad_templates() -> None:
    with pytest.raises(ValueError, match="not a valid template"):
        templates.check_template("ba{batch", "save_filename")
    with pytest.raises(TypeError, match="non-empty string"):
        templates.check_template("", "save_filename")


def test_glob_fills_place_fields_and_stars_time_fields() -> None:
    place = {"run_name": "r[1]", "rank": 0}
    assert glob_of("{run_name}-ep{epoch}-ba{batch}-rank{rank}.pt", place) == "r[[]1]-ep*-ba*-rank0.pt"


def test_time_fields_read_back_what_a_template_wrote() -> None:
    place = {"run_name": "r.1", "rank": 1}
    assert templates.time_fields("ep{epoch}-ba{batch}-rank{rank}.pt", place, "ep0-ba3-rank1.pt") == \
        {"epoch": 0, "batch": 3}
    assert templates.time_fields("ep{epoch}-ba{batch}-rank{rank}.pt", place, "ep0-ba3-rank0.pt") is None
    assert templates.time_fields("{run_name}/ba{batch:05d}/{batch}.pt", place, "r.1/ba00012/12.pt") == {"batch": 12}
    assert templates.time_fields("{run_name}/ba{batch:05d}/{batch}.pt", place, "r.1/ba00012/13.pt") is None
    assert templates.time_fields("{run_name}/ba{batch}.pt", place, "rx1/ba4.pt") is None  # '.' is no wildcard
