"""The SDK's and CLI's dataset commands against a real API server on loopback (uvicorn, SQLite,
the local store, the server-less broker)."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kiln.cli import app
from kiln.cli.common import console
from kiln.client import KilnClient
from kiln.examples import small_cnn
from schemas.errors import ErrorCode, KilnError
from services.api.auth import Role, mint_token
from tests.conftest import free_port
from tests.services.api.conftest import SECRET, make_settings

KEY = "ort-cpu-x86-64-v3-ort1.32"
runner = CliRunner()


@dataclass
class LiveApi:
    url: str
    token: str

    def client(self) -> KilnClient:
        return KilnClient(self.url, self.token)


@pytest.fixture
def live_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveApi]:
    """The API app served by uvicorn in a thread; the CLI finds it through KILN_API_URL."""
    import uvicorn

    from services.api.app import create_app

    port = free_port()
    (tmp_path / "api").mkdir()
    server = uvicorn.Server(uvicorn.Config(create_app(make_settings(tmp_path / "api")),
                                           host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("the API server did not start")
        time.sleep(0.05)
    live = LiveApi(f"http://127.0.0.1:{port}", mint_token(SECRET, role=Role.ADMIN, subject="t",
                                                         ttl_s=3600))
    monkeypatch.setenv("KILN_API_URL", live.url)
    monkeypatch.setenv("KILN_TOKEN", live.token)
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "client"))
    try:
        yield live
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def save(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


def images(n: int, *per_sample: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, *per_sample), dtype=np.float32)


def test_sdk_push_dedupes_and_lists(live_api: LiveApi, tmp_path: Path) -> None:
    path = save(tmp_path / "s.npz", image=images(3, 1, 3, 32, 32))
    with live_api.client() as client:
        info = client.push_dataset(path)
        assert info.id == hashlib.sha256(path.read_bytes()).hexdigest()
        assert info.samples == 3 and info.tensors[0].shape == [3, 1, 3, 32, 32]
        assert client.push_dataset(path.read_bytes()) == info
        assert client.list_datasets() == [info]
        assert client.get_dataset(info.id) == info
        with pytest.raises(KilnError, match="pickled object arrays are refused") as caught:
            client.push_dataset(save(tmp_path / "p.npz", image=np.array([None], dtype=object)))
        assert caught.value.code is ErrorCode.INVALID_REQUEST


def test_cli_dataset_push_and_list(live_api: LiveApi, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(console, "width", 200)
    path = save(tmp_path / "s.npz", image=images(2, 1, 3, 32, 32))
    pushed = runner.invoke(app, ["dataset", "push", str(path)])
    assert pushed.exit_code == 0, pushed.output
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest in pushed.output and "2 samples" in pushed.output
    listed = runner.invoke(app, ["datasets"])
    assert listed.exit_code == 0, listed.output
    # Piped: tab-separated, the id cut to a short unique prefix; whole with --full.
    assert f"\n{digest[:12]}\t2\timage float32[2, 1, 3, 32, 32]\t" in listed.output
    assert digest not in listed.output
    assert f"\n{digest}\t" in runner.invoke(app, ["datasets", "--full"]).output
    bad = runner.invoke(app, ["dataset", "push", str(tmp_path / "missing.npz")])
    assert bad.exit_code == 2


def test_cli_submit_pushes_samples_and_calibration(live_api: LiveApi, tmp_path: Path) -> None:
    model = tmp_path / "cnn.onnx"
    model.write_bytes(small_cnn(batch=1).SerializeToString())
    samples = save(tmp_path / "s.npz", image=images(4, 1, 3, 32, 32))
    calibration = save(tmp_path / "c.npz", image=images(8, 1, 3, 32, 32))
    result = runner.invoke(app, ["submit", str(model), "--target", KEY, "--samples",
                                 str(samples), "--calibration", str(calibration)])
    assert result.exit_code == 0, result.output
    with live_api.client() as client:
        (job,) = client.list_jobs()
    assert job.options.samples == hashlib.sha256(samples.read_bytes()).hexdigest()
    assert job.options.calibration == hashlib.sha256(calibration.read_bytes()).hexdigest()

    unbatched = save(tmp_path / "u.npz", image=images(4, 3, 32, 32))  # batch axis left out
    refused = runner.invoke(app, ["submit", str(model), "--target", KEY, "--samples",
                                  str(unbatched)])
    assert isinstance(refused.exception, KilnError)
    assert refused.exception.code is ErrorCode.INVALID_OPTIONS
    assert "input 'image' has shape [1, 3, 32, 32]" in refused.exception.message


def test_token_revoke_from_the_cli(live_api: LiveApi):
    victim = mint_token(SECRET, role=Role.WORKER, subject="w", ttl_s=600, keys=["*"])
    claims = __import__("jwt").decode(victim, options={"verify_signature": False})
    assert KilnClient(live_api.url, victim).list_datasets() == []
    result = runner.invoke(app, ["token", "revoke", claims["jti"], "--reason", "test"])
    assert result.exit_code == 0, result.output
    assert f"token {claims['jti']} revoked" in result.output
    with pytest.raises(KilnError) as refused:
        KilnClient(live_api.url, victim).list_datasets()
    assert refused.value.code is ErrorCode.UNAUTHENTICATED and "revoked" in refused.value.message
    again = runner.invoke(app, ["token", "revoke", claims["jti"]])
    assert "was already revoked" in again.output
