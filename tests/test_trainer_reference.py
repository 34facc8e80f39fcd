"""The reference of every Trainer argument cannot drift from the signature: the class docstring
documents exactly the signature's arguments, in its order, and docs/trainer-arguments.md is what
scripts/trainer_reference.py makes of them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lockstep import Trainer

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "trainer_reference.py"


def _reference():
    spec = importlib.util.spec_from_file_location("trainer_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docstring_documents_every_argument_of_the_signature_in_order() -> None:
    reference = _reference()
    documented, signature = reference.documented(Trainer), list(reference.parameters(Trainer))
    assert list(documented) == signature, (
        f"undocumented: {sorted(set(signature) - set(documented))}; "
        f"not in the signature: {sorted(set(documented) - set(signature))}")
    assert all(len(text) > 20 for text in documented.values()), [n for n, t in documented.items() if len(t) <= 20]


def test_the_reference_page_is_current() -> None:
    reference = _reference()
    assert reference.PAGE.read_text() == reference.page(), "run: python scripts/trainer_reference.py"
