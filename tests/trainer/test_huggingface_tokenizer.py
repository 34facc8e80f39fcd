"""HuggingFaceModel's tokenizer must be a tokenizer object (issue 49): a string such as "gpt2" was
accepted (``len("gpt2")`` passed the vocabulary check) and stored as the tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from lockstep.models import HuggingFaceModel  # noqa: E402
from tests.trainer.test_huggingface import gpt2, tokenizer  # noqa: E402


@pytest.mark.parametrize("name", ["gpt2", Path("/models/gpt2")])
def test_a_tokenizer_name_or_path_is_a_one_line_type_error(name) -> None:
    with pytest.raises(TypeError) as error:
        HuggingFaceModel(gpt2(), tokenizer=name)
    message = str(error.value)
    assert f"AutoTokenizer.from_pretrained({str(name)!r})" in message and "\n" not in message, message


def test_another_object_is_a_type_error_and_a_tokenizer_is_taken() -> None:
    with pytest.raises(TypeError, match="takes a transformers tokenizer .* got a dict"):
        HuggingFaceModel(gpt2(), tokenizer={"vocab": 3})
    tok = tokenizer()
    assert HuggingFaceModel(gpt2(), tokenizer=tok).tokenizer is tok
    assert HuggingFaceModel(gpt2()).tokenizer is None
