"""The smaller endpoints and request ids through a live Serve app (its HTTP proxy in front):
``/tokenize``, ``/detokenize``, ``/version``, ``/v1/models/{id}``, and one ``X-Request-Id`` on
every answer."""

from __future__ import annotations

import httpx
import pytest

from tests.cluster.helpers import KEYS, MODEL, ServeApp, assert_error, headers
from tierserve import __version__

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_the_endpoints_and_request_ids_under_serve(main_app: ServeApp) -> None:
    key = headers(KEYS["standard"])
    with httpx.Client(timeout=60) as http:
        r = http.post(main_app.url("/tokenize"), json={"model": MODEL, "prompt": "Hello there"},
                      headers={**key, "X-Request-Id": "live-1"})
        assert r.status_code == 200, r.text
        assert r.headers.get_list("x-request-id") == ["live-1"]  # the proxy's, once
        ids = r.json()["tokens"]
        assert r.json()["count"] == len(ids) > 0
        r = http.post(main_app.url("/detokenize"), json={"model": MODEL, "tokens": ids},
                      headers=key)
        assert r.status_code == 200 and "Hello there" in r.json()["prompt"], r.text
        assert len(r.headers.get_list("x-request-id")) == 1  # made by the proxy
        err = assert_error(http.post(main_app.url("/detokenize"),
                                     json={"model": MODEL, "tokens": [10**7]}, headers=key),
                           400, "invalid_token")
        assert err["param"] == "tokens.0"
        r = http.post(main_app.url("/v1/completions"), headers={**key, "X-Request-Id": "live-2"},
                      json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["id"] == "cmpl-live-2", r.text
        r = http.get(main_app.url("/v1/models/no-such"), headers={"X-Request-Id": "live-3"})
        err = assert_error(r, 404, "model_not_found")
        assert err["request_id"] == "live-3" and r.headers.get_list("x-request-id") == ["live-3"]
        assert http.get(main_app.url(f"/v1/models/{MODEL}")).json()["id"] == MODEL
        assert http.get(main_app.url("/version")).json() == {"version": __version__}
