"""Where the CLI and SDK find the API: flags, then ``KILN_API_URL``/``KILN_TOKEN``, then the
``client.json`` that ``kiln up`` writes under ``KILN_HOME``."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict

CLIENT_FILE = "client.json"


class ClientSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_", extra="ignore")

    #: Where `client.json` (written by `kiln up`) is looked for.
    home: Path = Path(".kiln")
    #: The API the CLI and SDK talk to (else `client.json`, else `http://127.0.0.1:8000`).
    api_url: str | None = None
    #: Bearer token of the CLI and SDK (else `client.json`).
    token: str | None = None

    def resolved(self) -> tuple[str, str | None]:
        api_url, token = self.api_url, self.token
        path = self.home / CLIENT_FILE
        if (api_url is None or token is None) and path.exists():
            saved = json.loads(path.read_text())
            api_url = api_url or saved.get("api_url")
            token = token or saved.get("token")
        return api_url or "http://127.0.0.1:8000", token


def write_client_file(home: Path, *, api_url: str, token: str) -> Path:
    path = home / CLIENT_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"api_url": api_url, "token": token}, indent=2))
    tmp.chmod(0o600)
    tmp.replace(path)
    return path
