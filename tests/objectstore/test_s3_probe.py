"""The bucket probe at Trainer(...) tells an endpoint that is no S3 server from a missing bucket
(issue 49): a web server's 404, or SeaweedFS's filer port instead of its S3 port, was reported as
"bucket ... does not exist"."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lockstep import Trainer
from tests.trainer.common import MLP, error_of, loader

pytestmark = pytest.mark.timeout(90)

NOT_S3 = "does not look like an S3 server"


@pytest.fixture
def web_server(tmp_path: Path) -> Iterator[str]:
    """A plain web server on a free port, answering 404 to every path; stopped after the test."""
    (tmp_path / "site").mkdir()
    handler = functools.partial(_Quiet, directory=str(tmp_path / "site"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def _trainer(**kwargs) -> Trainer:
    model = MLP()
    return Trainer(model=model, train_dataloader=loader(4), optimizers=torch.optim.AdamW(model.parameters()),
                   device="cpu", progress_bar=False, max_duration="2ba", **kwargs)


@pytest.mark.parametrize("endpoint", ["web server", "SeaweedFS filer", "SeaweedFS master"])
@pytest.mark.parametrize("argument", ["save_folder", "load_path"])
def test_an_endpoint_that_is_no_s3_server_is_named_so(s3_server, s3_env: dict[str, str], web_server: str,
                                                      tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      endpoint: str, argument: str) -> None:
    monkeypatch.chdir(tmp_path)
    url = web_server if endpoint == "web server" else \
        f"http://127.0.0.1:{s3_server.ports[2 if endpoint == 'SeaweedFS filer' else 0]}"
    monkeypatch.setenv("S3_ENDPOINT_URL", url)
    path = "s3://ckpt/x" + ("/ep0-ba2-rank0.pt" if argument == "load_path" else "")
    error = error_of(_trainer, **{argument: path})
    assert NOT_S3 in error and "S3_ENDPOINT_URL" in error and "'ckpt'" in error, error
    assert "does not exist" not in error and "\n" not in error, error


def test_a_missing_bucket_on_an_s3_server_is_still_named_missing(s3_env: dict[str, str], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    error = error_of(_trainer, save_folder="s3://no-such-bucket/x")
    assert "'no-such-bucket'" in error and "does not exist" in error and NOT_S3 not in error, error
