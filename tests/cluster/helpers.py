"""Helpers for the cluster tests: a real local Ray Serve app on CPU, started and stopped here.

The apps are deployed from ``configs/cluster.yaml`` itself, the way ``serve run`` does it: the
application's config goes to the Serve controller as a ``ServeDeploySchema``, so the YAML's
``deployments`` section (two replicas, ``FreeKVBlocksRouter``, a 1 s stats period) is what runs.
Only the engine's sizes and the API keys are changed, and a second app (``solo``: one small
replica, keys required) is added for the tests that need one replica's queue to themselves.

``serve.run`` takes an ``Application`` and has no way to apply the YAML's per-deployment options,
hence Serve's own (private, but it is what the CLI calls) ``serve_start`` and ``deploy_apps``.

One Ray instance serves every module of this package that asks for ``main_app`` or ``solo_app``
(starting Ray and the replicas costs most of a minute on two cores); the two-node module stops it
first and starts its own cluster.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import ray
import yaml
from ray import serve
from ray.serve._private.api import serve_start
from ray.serve.schema import ServeDeploySchema

from tierserve.records import EngineStats

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_YAML = ROOT / "configs" / "cluster.yaml"
MODEL = "tierserve-tiny"
KEYS = {"interactive": "test-key-interactive", "standard": "test-key-standard",
        "batch": "test-key-batch"}
# The apps name their keys by environment variable (Serve logs an app's args): set here, before
# any test starts Ray, so that every Ray worker (the ingress) inherits them.
KEY_VARS = {tier: f"TIERSERVE_TEST_KEY_{tier.upper()}" for tier in KEYS}
os.environ.update({KEY_VARS[tier]: key for tier, key in KEYS.items()})

# The main app: 96 blocks of 16 per replica (a request that could grow past 1536 tokens never
# fits: 400), room for 64 concurrent requests without shedding, and the deterministic mode so
# that the served tokens are exactly those of an in-process ``LLM`` (batch invariance).
MAIN_ENGINE: dict[str, Any] = {"num_kv_blocks": 96, "kv_cache_memory_bytes": None, "max_num_seqs": 16,
                               "max_waiting": 128, "deterministic": True, "device": "cpu"}
MAIN_ARGS: dict[str, Any] = {"max_tokens_limit": 2048}
# The solo app: one replica running at most 2 requests, a queue of 8 (the YAML's tiers shed
# batch at 4 waiting, standard at 6, interactive is refused at 8), a pool that holds two
# requests of 2000 tokens, and no anonymous tier (a key is required). Flow control is off: its
# tests are of what the replica itself refuses (tests/cluster/test_flow.py has the ingress's).
SOLO_ENGINE: dict[str, Any] = {"num_kv_blocks": 260, "kv_cache_memory_bytes": None, "max_num_seqs": 2,
                               "max_waiting": 8, "deterministic": True, "device": "cpu"}
SOLO_ARGS: dict[str, Any] = {"anonymous_tier": None, "max_tokens_limit": 2048,
                             "flow": {"enabled": False}}

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def cluster_yaml() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(CLUSTER_YAML.read_text())
    return loaded


def app_config(
    name: str,
    route_prefix: str,
    engine: dict[str, Any],
    args: dict[str, Any],
    deployments: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The YAML's application, renamed, with engine/args/deployment options overridden. It serves
    the embedded ``MODEL`` (fast, random weights) unless ``engine`` names another."""
    app = copy.deepcopy(cluster_yaml()["applications"][0])
    app["name"] = name
    app["route_prefix"] = route_prefix
    app["args"]["engine"]["model"] = MODEL
    app["args"]["engine"].update(engine)
    app["args"].update(args)
    for tier in app["args"]["tiers"]:
        tier["api_keys"] = [f"env:{KEY_VARS[tier['name']]}"]
    # Every tier has a key: a request without one may only get the lowest tier.
    app["args"]["anonymous_tier"] = args.get("anonymous_tier", "batch")
    for dep in app["deployments"]:
        dep.update((deployments or {}).get(dep["name"], {}))
    return app


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = 120.0,
             every_s: float = 0.05) -> T:
    """Poll ``probe`` until it returns something truthy; fail, saying ``what``, after a long wait."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every_s)
    raise AssertionError(f"gave up waiting for {what} (last seen: {last!r})")


def start_serve(port: int) -> Any:
    top = cluster_yaml()
    return serve_start(http_options={"host": "127.0.0.1", "port": port},
                       proxy_location=top["proxy_location"])


def deploy(client: Any, apps: list[dict[str, Any]], timeout_s: float = 300.0) -> None:
    """Apply the config (every app at once, as ``serve run`` would) and wait until all run."""
    client.deploy_apps(ServeDeploySchema.model_validate({"applications": apps}))
    names = [a["name"] for a in apps]

    def running() -> bool:
        status = serve.status().applications
        for name in names:
            app = status.get(name)
            if app is not None and app.status == "DEPLOY_FAILED":
                raise RuntimeError(f"app {name!r} failed to deploy: {app.message}")
        return all(n in status and status[n].status == "RUNNING" for n in names)

    wait_for(f"apps {names} to run", running, timeout_s, every_s=0.5)


@dataclass
class ServeApp:
    """One deployed tierserve app, seen from the test: its URL and its engine replicas."""

    name: str
    base_url: str  # http://127.0.0.1:PORT/PREFIX (no trailing slash)
    num_replicas: int
    baseline: dict[str, int] = field(default_factory=dict)  # replica -> free blocks when idle

    def url(self, path: str) -> str:
        return self.base_url + path

    # ------------------------------------------------------------------ replicas

    def replicas(self) -> dict[str, Any]:
        """Every live ``LLMServer`` replica actor of this app, by actor name."""
        prefix = f"SERVE_REPLICA::{self.name}#LLMServer#"
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["name"].startswith(prefix))
        return {n: ray.get_actor(n, namespace="serve") for n in names}

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """Each replica's own report (``record_routing_stats``), asked of that replica directly."""
        actors = self.replicas()
        refs = {n: a.record_routing_stats.remote() for n, a in actors.items()}
        return {n: ray.get(r, timeout=30) for n, r in refs.items()}

    def node_ids(self) -> dict[str, str]:
        """The Ray node of each replica (``ReplicaActor.is_allocated`` reports it)."""
        return {n: ray.get(a.is_allocated.remote(), timeout=30)[3]
                for n, a in self.replicas().items()}

    def engine_stats(self) -> EngineStats:
        """``LLMServer.stats()`` through a handle: only meaningful with one replica."""
        assert self.num_replicas == 1
        handle = serve.get_deployment_handle("LLMServer", app_name=self.name)
        result: EngineStats = handle.stats.remote().result(timeout_s=30)
        return result

    def wait_stats(self, what: str, ok: Callable[[dict[str, dict[str, Any]]], bool],
                   timeout_s: float = 120.0) -> dict[str, dict[str, Any]]:
        """Every replica's report, once ``ok`` holds for them (failing after a long wait)."""
        seen: list[dict[str, dict[str, Any]]] = []

        def probe() -> dict[str, dict[str, Any]] | None:
            stats = self.replica_stats()
            seen[:] = [stats]
            return stats if len(stats) == self.num_replicas and ok(stats) else None

        try:
            return wait_for(f"{self.name}: {what}", probe, timeout_s)
        except AssertionError as e:
            raise AssertionError(f"{e}; replicas reported {seen}") from None

    def wait_idle(self, timeout_s: float = 120.0) -> dict[str, dict[str, Any]]:
        """Until every replica has nothing waiting or running and all its blocks free."""
        return self.wait_stats(
            "every replica idle with all blocks free",
            lambda stats: all(s["waiting"] == 0 and s["running"] == 0
                              and s["free_blocks"] == s["total_blocks"] for s in stats.values()),
            timeout_s,
        )

    def until_every_replica_serves(self, timeout_s: float = 120.0) -> None:
        """Short completions until every replica has run a step for one, then until all are
        idle again: the ingress's router ranks a replica only once the replica's first report
        has reached it, so a test that needs the router to choose between all of them waits
        for this (``wait_ready`` asks the replicas themselves)."""
        before = {k: int(v["steps"]) for k, v in self.replica_stats().items()}

        def served() -> bool:
            for i in range(4):
                r = httpx.post(self.url("/v1/completions"), timeout=60, json={
                    "model": MODEL, "prompt": f"warm {i}", "max_tokens": 2})
                assert r.status_code == 200, r.text
            now = {k: int(v["steps"]) for k, v in self.replica_stats().items()}
            return len(now) == self.num_replicas and all(now[k] > before.get(k, 0) for k in now)

        wait_for(f"{self.name}: every replica serving", served, timeout_s, every_s=0.5)
        self.wait_idle()

    def wait_ready(self) -> None:
        """The app runs, has all its replicas and every one is idle; records the baseline."""
        wait_for(f"{self.name} to run",
                 lambda: serve.status().applications[self.name].status == "RUNNING",
                 timeout_s=300, every_s=0.5)
        stats = self.wait_idle(timeout_s=300)
        self.baseline = {n: int(s["free_blocks"]) for n, s in stats.items()}

    # ------------------------------------------------------------------ clients

    def client(self, key: str | None = None) -> openai.OpenAI:
        """The ``openai`` client; with ``key=None`` send ``oa_headers(None)`` on each request."""
        return openai.OpenAI(base_url=self.url("/v1"), api_key=key or "no-key", max_retries=0,
                             timeout=120)

    def async_client(self, key: str | None = None) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url("/v1"), api_key=key or "no-key",
                                  max_retries=0, timeout=120)


def headers(key: str | None = None, priority: int | str | None = None) -> dict[str, str]:
    out = {}
    if key is not None:
        out["Authorization"] = f"Bearer {key}"
    if priority is not None:
        out["X-TL-Priority"] = str(priority)
    return out


def oa_headers(key: str | None, priority: int | None = None) -> dict[str, Any]:
    """``extra_headers`` for an ``openai`` call: the priority, and no Authorization without a key."""
    out: dict[str, Any] = headers(priority=priority)
    if key is None:
        out["Authorization"] = openai.Omit()
    return out


def sse_events(lines: Iterator[str]) -> Iterator[Any]:
    """The JSON payloads of an SSE body's ``data:`` lines, then the string ``"[DONE]"``."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        yield data if data == "[DONE]" else json.loads(data)


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    """An OpenAI-shaped JSON error with ``status`` (and ``code``); returns its ``error`` object."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    err: dict[str, Any] = body["error"]
    assert set(err) == {"message", "type", "code", "param", "request_id"}, err
    # The request's id, the response's X-Request-Id (Serve's proxy sets that header, once).
    assert response.headers.get_list("x-request-id") == [err["request_id"]], response.headers
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if code is not None:
        assert err["code"] == code, err
    if status == 429:
        assert response.headers.get("retry-after", "").isdigit(), response.headers
    return err


class LocalServe:
    """Ray on this machine with Serve and the ``main`` and ``solo`` apps; started on first use.

    ``add`` deploys one more app beside them (a module's own, e.g. with fault injection on) and
    ``remove`` takes it down again (Serve's config is declarative: every deploy lists all apps).
    """

    def __init__(self) -> None:
        self.apps: dict[str, ServeApp] | None = None
        self.client: Any = None
        self.port = 0
        self.configs: dict[str, dict[str, Any]] = {}

    def ensure(self) -> dict[str, ServeApp]:
        if self.apps is None:
            self.apps = self._start()
        return self.apps

    def _start(self) -> dict[str, ServeApp]:
        ray.init(address="local", num_cpus=8, include_dashboard=False,
                 logging_level=logging.WARNING, log_to_driver=False)
        try:
            self.port = free_port()
            self.client = start_serve(self.port)
            self.configs = {
                "main": app_config("tierserve", "/", MAIN_ENGINE, MAIN_ARGS),
                "solo": app_config("solo", "/solo", SOLO_ENGINE, SOLO_ARGS,
                                   {"LLMServer": {"num_replicas": 1}}),
            }
            deploy(self.client, list(self.configs.values()))
        except BaseException:
            self._shutdown()
            raise
        base = f"http://127.0.0.1:{self.port}"
        return {"main": ServeApp("tierserve", base, 2), "solo": ServeApp("solo", base + "/solo", 1)}

    def add(self, key: str, config: dict[str, Any]) -> ServeApp:
        """Deploy one more app (``app_config(...)``) beside the others; returns it, ready."""
        apps = self.ensure()
        self.configs[key] = config
        deploy(self.client, list(self.configs.values()))
        replicas = next(d.get("num_replicas", 1) for d in config["deployments"]
                        if d["name"] == "LLMServer")
        prefix = config["route_prefix"].rstrip("/")
        app = ServeApp(config["name"], f"http://127.0.0.1:{self.port}{prefix}", replicas)
        apps[key] = app
        app.wait_ready()
        return app

    @contextlib.contextmanager
    def app(self, key: str, config: dict[str, Any]) -> Iterator[ServeApp]:
        """``add`` for the duration of a ``with`` block (a module fixture's body), then ``remove``."""
        app = self.add(key, config)
        try:
            yield app
        finally:
            self.remove(key)

    def remove(self, key: str) -> None:
        """Take an app that ``add`` deployed down again."""
        if self.apps is None or key not in self.configs or key in ("main", "solo"):
            return
        name = self.configs.pop(key)["name"]
        self.apps.pop(key, None)
        deploy(self.client, list(self.configs.values()))
        wait_for(f"app {name} to go", lambda: name not in serve.status().applications,
                 timeout_s=120, every_s=0.5)

    @staticmethod
    def _shutdown() -> None:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()

    def stop(self) -> None:
        if self.apps is not None:
            self.apps = None
            self._shutdown()
