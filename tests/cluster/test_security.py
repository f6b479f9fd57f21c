"""Security promises that a live cluster must keep (see the README's promises section)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import ray

from tests.cluster.helpers import KEYS, MODEL, ServeApp, assert_error, headers

pytestmark = [pytest.mark.ray, pytest.mark.slow]

WRONG_KEY = "sk-wrong-0123456789abcdef"


def test_api_keys_never_reach_the_logs(main_app: ServeApp) -> None:
    body = {"model": MODEL, "prompt": "secret?", "max_tokens": 2}
    for key in KEYS.values():
        r = httpx.post(main_app.url("/v1/completions"), json=body, headers=headers(key),
                       timeout=60)
        assert r.status_code == 200, r.text
    r = httpx.post(main_app.url("/v1/completions"), json=body, headers=headers(WRONG_KEY),
                   timeout=60)
    err = assert_error(r, 401, "invalid_api_key")
    assert WRONG_KEY not in r.text and WRONG_KEY not in err["message"]
    node = ray._private.worker._global_node
    assert node is not None
    logs = Path(node.get_logs_dir_path())
    files = [p for p in logs.rglob("*") if p.is_file()]
    assert files, f"no log files under {logs}"
    for path in files:
        data = path.read_bytes()
        for secret in [*KEYS.values(), WRONG_KEY]:
            assert secret.encode() not in data, f"{secret!r} appears in {path}"


def test_the_openapi_document_does_not_leak_keys(main_app: ServeApp) -> None:
    text = httpx.get(main_app.url("/openapi.json"), timeout=30).text
    assert all(k not in text for k in KEYS.values())
