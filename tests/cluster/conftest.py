"""Fixtures for the cluster tests (see ``tests.cluster.helpers`` for how the apps are deployed).

``local_serve`` lives as long as this package's tests: one Ray instance with Serve and both apps
serves every module that asks for ``main_app`` or ``solo_app``; the two-node module stops it first.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster.helpers import LocalServe, ServeApp


@pytest.fixture(scope="package")
def local_serve() -> Iterator[LocalServe]:
    ls = LocalServe()
    try:
        yield ls
    finally:
        ls.stop()


@pytest.fixture(scope="module")
def main_app(local_serve: LocalServe) -> ServeApp:
    app = local_serve.ensure()["main"]
    app.wait_ready()
    return app


@pytest.fixture(scope="module")
def solo_app(local_serve: LocalServe) -> ServeApp:
    app = local_serve.ensure()["solo"]
    app.wait_ready()
    return app
