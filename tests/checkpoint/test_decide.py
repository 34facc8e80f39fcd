"""The loader's decision, from every rank's probe, as a table: no processes, no files."""

from __future__ import annotations

import pytest

from lockstep.checkpoint.loader import Fail, Fresh, Load, Probe, StartOver, StepBack, decide

SHARED = Probe(found=True, shared=True, batch=4, saves=2, path="ck/ba4.pt")
SENDER = Probe(found=True, shared=True, batch=4, saves=2, path="ck/ba4.pt", can_send=True)
OWN = Probe(found=True, batch=4, saves=2, path="ck/ba4-rank1.pt")
MISSING = Probe(error="load_path 'ck/x.pt': ck/x.pt does not exist")
BROKEN = Probe(found=True, shared=True, path="ck/ba4.pt", error="ck/ba4.pt: CRC mismatch in record data/3",
               damaged=True)
UNFIT = Probe(found=True, shared=True, path="ck/ba4.pt", error="ck/ba4.pt does not fit the model")


def own(batch: int, saves: int = 2) -> Probe:
    return Probe(found=True, batch=batch, saves=saves, path=f"ck/ba{batch}.pt")


CASES = [
    # (probes, optional, per_rank_files, collective) -> action
    ("one rank loads its file", [SHARED], False, False, False, Load()),
    ("every rank reads rank 0's file", [SENDER, SHARED], False, False, False, Load()),
    ("a collective layout agrees after applying", [SENDER, SHARED], False, False, True, Load(agree=True)),
    ("autoresume with nothing anywhere starts fresh", [MISSING, MISSING], True, False, False, Fresh()),
    ("a load_path that exists nowhere fails", [MISSING, MISSING], False, False, False,
     Fail("rank 0: load_path 'ck/x.pt': ck/x.pt does not exist")),
    ("a damaged file fails on every rank, naming the first rank", [SHARED, BROKEN], False, False, False,
     Fail("rank 1: ck/ba4.pt: CRC mismatch in record data/3", damaged=True)),
    ("a damaged file fails before a missing one is considered", [MISSING, BROKEN], True, False, False,
     Fail("rank 1: ck/ba4.pt: CRC mismatch in record data/3", damaged=True)),
    ("bad bytes one rank found win over the failure another rank had reading them", [UNFIT, BROKEN], True, False,
     False, Fail("rank 1: ck/ba4.pt: CRC mismatch in record data/3", damaged=True)),
    ("a file that does not fit is not called damaged", [UNFIT, SHARED], True, False, False,
     Fail("rank 0: ck/ba4.pt does not fit the model")),
    ("ranks that do not see rank 0's file receive it", [SENDER, MISSING], False, False, False, Load(receive=True)),
    ("a folder layout cannot be sent", [SHARED, MISSING], False, False, True,
     Fail("rank 1: load_path 'ck/x.pt': ck/x.pt does not exist while other ranks found theirs: is it on a "
          "file system every node sees?")),
    ("one rank on its own file voids the CRC split", [SENDER, OWN], False, False, False,
     Load(check_whole=True, agree=True)),
    ("per-rank files agree after applying", [own(4), own(4)], False, True, False, Load(agree=True)),
    ("per-rank files of different steps fail for load_path", [own(4), own(6)], False, True, False,
     Fail("the ranks loaded checkpoints of different steps (batches 4 to 6): the per-rank files of "
          "'ck/x.pt' are not from one save")),
    ("autoresume steps back to the step every rank has", [own(6), own(4)], True, True, False, StepBack(4)),
    ("autoresume of a first save only some ranks published starts over", [own(2, saves=1), MISSING], True, True,
     False, StartOver()),
    ("a rank with a history while another has nothing names the cause", [own(6, saves=3), MISSING], True, True,
     False, Fail("rank 0: ck/ba6.pt is this rank's checkpoint number 3 of the run, yet other ranks find no "
                 "latest pointer at all: their files are gone (save_folder must be the same folder for every "
                 "rank, e.g. on a shared file system)")),
]


@pytest.mark.parametrize("probes, optional, per_rank, collective, expected", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_decide(probes: list[Probe], optional: bool, per_rank: bool, collective: bool, expected: object) -> None:
    action = decide(probes, optional=optional, per_rank_files=per_rank, collective=collective, template="ck/x.pt")
    assert action == expected


def test_one_rank_has_no_rank_prefix() -> None:
    assert decide([BROKEN], optional=False, per_rank_files=False, collective=False,
                  template="ck/x.pt") == Fail("ck/ba4.pt: CRC mismatch in record data/3", damaged=True)
