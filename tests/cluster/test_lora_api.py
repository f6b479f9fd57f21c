"""LoRA adapters over HTTP, without Ray (``stub_ingress``: the real ingress over stand-in engine
handles whose LoRA methods refuse as a replica does): a request's ``model`` naming an adapter
(the ``GenerateRequest`` carries its ``LoRARequest``, the answer echoes its name, its prefix
hashes are its own), allowlists (a tenant's adapter is a 404 to others, which names nothing it
may not use), ``/v1/models`` with ``parent``, the admin routes ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` and each of their refusals, the registry's rules
(``tierserve.cluster.adapters``) and the config's."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.stub_ingress import StubIngress
from tierserve.cluster.adapters import (
    AdapterRegistry,
    AdapterStoreActor,
    DynamicAdapters,
    LocalStore,
    check_path,
)
from tierserve.cluster.app import load_config
from tierserve.cluster.tiers import TierResolver
from tierserve.records import (
    BadRequest,
    ErrorRecord,
    LoRARequest,
    NotFound,
    ServingError,
    Unavailable,
    static_lora_id,
)

CHAT, TINY = "smollm2-135m-instruct", "tierserve-tiny"
ADMIN, PAID, ACME, LAB, FREE = "sk-admin", "sk-paid", "sk-acme", "sk-lab", "sk-free"
LONG = "The quick brown fox jumps over the lazy dog. " * 8  # several full KV blocks


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def error(answer: Any, status: int) -> dict[str, Any]:
    assert answer.status == status, answer.body
    out: dict[str, Any] = answer.body["error"]
    return out


def adapter_dir(root: Path, name: str, rank: int = 8) -> Path:
    """A folder the stand-in replica takes as an adapter (its ``adapter_config.json``)."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    return path


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("lora")
    allowed = base / "adapters"
    outside = base / "elsewhere"
    for name in ("sql", "acme-ft", "acme-v2", "one", "two", "three", "gone", "busy", "spent"):
        adapter_dir(allowed, name)
    adapter_dir(allowed, "wide", rank=64)
    (allowed / "empty").mkdir()
    adapter_dir(outside, "stray")
    os.symlink(outside / "stray", allowed / "link")
    return {"allowed": allowed, "outside": outside}


def config(roots: dict[str, Path], **extra: Any) -> dict[str, Any]:
    models = [
        {"name": CHAT, "engine": {"model": CHAT, "max_model_len": 1024, "enable_lora": True,
                                  "max_cpu_loras": 4,
                                  "lora_modules": [{"name": "sql",
                                                    "path": str(roots["allowed"] / "sql")}]}},
        {"name": "tiny", "engine": {"model": TINY, "max_model_len": 512}},
    ]
    return {
        "models": models,
        "tiers": [
            {"name": "paid", "base_priority": 5, "max_priority": 9, "api_keys": [ADMIN, PAID],
             "tenants": [{"name": "acme", "api_keys": [ACME], "models": [CHAT, "acme-ft"]},
                         {"name": "lab", "api_keys": [LAB], "models": [CHAT, "tiny"]}]},
            {"name": "free", "base_priority": 0, "max_priority": 4, "api_keys": [FREE],
             "models": [CHAT]},
        ],
        "anonymous_tier": "free",
        "admin_keys": [ADMIN],
        "lora_path_roots": [str(roots["allowed"])],
        "max_dynamic_loras": 3,
        **extra,
    }


@pytest.fixture(scope="module")
def stub(roots: dict[str, Path]) -> StubIngress:
    return StubIngress(config(roots))


def load(stub: StubIngress, name: str, path: Path | str, key: str = ADMIN,
         **extra: Any) -> Any:
    return stub.post("/v1/load_lora_adapter",
                     {"lora_name": name, "lora_path": str(path), **extra}, auth(key))


def unload(stub: StubIngress, name: str, key: str = ADMIN) -> Any:
    return stub.post("/v1/unload_lora_adapter", {"lora_name": name}, auth(key))


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            **extra}


# ------------------------------------------------------------------ requests naming an adapter


def test_a_request_naming_a_static_adapter_runs_under_it(stub: StubIngress,
                                                         roots: dict[str, Path]) -> None:
    h = stub.handles[CHAT]
    a = stub.post("/v1/chat/completions", chat("sql"), auth(PAID))
    assert a.status == 200 and a.body["model"] == "sql"
    path = str(roots["allowed"] / "sql")
    # Its id: the digest of its name and path as the config writes them (the replicas compute
    # the same, so the two agree without passing it).
    assert h.sent[-1].lora == LoRARequest("sql", static_lora_id("sql", path), path)
    c = stub.post("/v1/completions", {"model": "sql", "prompt": "Hi", "max_tokens": 2,
                                      "stream": True}, auth(PAID))
    assert c.status == 200 and {e["model"] for e in c.body} == {"sql"}
    r = stub.post("/v1/responses", {"model": "sql", "input": "Hi", "max_output_tokens": 4},
                  auth(PAID))
    assert r.status == 200 and r.body["model"] == "sql"
    assert h.sent[-1].lora is not None and h.sent[-1].lora.lora_name == "sql"
    base = stub.post("/v1/chat/completions", chat(CHAT), auth(PAID))
    assert base.body["model"] == CHAT and h.sent[-1].lora is None
    t = stub.post("/tokenize", {"model": "sql", "prompt": "Hello there"}, auth(PAID))
    assert t.status == 200 and t.body["tokens"] == stub.post(
        "/tokenize", {"model": CHAT, "prompt": "Hello there"}, auth(PAID)).body["tokens"]


def test_an_adapter_s_prefix_hashes_are_its_own(stub: StubIngress) -> None:
    h = stub.handles[CHAT]
    hashes = {}
    for model in (CHAT, "sql", CHAT):
        assert stub.post("/v1/completions", {"model": model, "prompt": LONG, "max_tokens": 1},
                         auth(PAID)).status == 200
        hashes.setdefault(model, []).append(h.sent[-1].prefix_hashes)
    base, (adapter,) = hashes[CHAT], hashes["sql"]
    assert base[0] and base[0] == base[1]  # the base's are stable
    assert adapter and not set(adapter) & set(base[0])  # no block named alike


def test_a_forbidden_adapter_is_a_404_that_names_nothing_it_may_not_use(
        stub: StubIngress) -> None:
    forbidden = error(stub.post("/v1/chat/completions", chat("sql"), auth(FREE)), 404)
    unknown = error(stub.post("/v1/chat/completions", chat("nosuch"), auth(FREE)), 404)
    assert forbidden["code"] == unknown["code"] == "model_not_found"
    assert forbidden["message"].replace("'sql'", "X") == unknown["message"].replace(
        "'nosuch'", "X")
    assert "sql" not in forbidden["message"].replace("'sql' does not", "")
    anon = error(stub.post("/v1/completions", {"model": "sql", "prompt": "Hi"}), 404)
    assert anon["code"] == "model_not_found"
    assert error(stub.get("/v1/models/sql", auth(FREE)), 404)["code"] == "model_not_found"
    assert error(stub.post("/tokenize", {"model": "sql", "prompt": "x"}, auth(FREE)),
                 404)["code"] == "model_not_found"


def test_models_lists_the_adapters_a_caller_may_use_with_their_parent(
        stub: StubIngress) -> None:
    cards = {m["id"]: m for m in stub.get("/v1/models", auth(PAID)).body["data"]}
    assert cards["sql"]["parent"] == CHAT and cards["sql"]["root"] == "sql"
    assert cards[CHAT]["parent"] is None and cards[CHAT]["root"] == CHAT
    assert "/" not in json.dumps(cards["sql"]).replace(CHAT, "")  # no server path
    assert list(cards)[:2] == [CHAT, "tiny"]  # the models first
    assert [m["id"] for m in stub.get("/v1/models", auth(FREE)).body["data"]] == [CHAT]
    one = stub.get("/v1/models/sql", auth(PAID))
    assert one.status == 200 and one.body["id"] == "sql" and one.body["parent"] == CHAT


# ------------------------------------------------------------------ the admin routes


@pytest.mark.parametrize("key", [PAID, ACME, FREE, None])
@pytest.mark.parametrize("route", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_only_an_admin_key_may_load_or_unload(stub: StubIngress, roots: dict[str, Path],
                                              key: str | None, route: str) -> None:
    calls = len(stub.handles[CHAT].calls)
    a = stub.post(route, {"lora_name": "one", "lora_path": str(roots["allowed"] / "one")}
                  if route.endswith("/load_lora_adapter") else {"lora_name": "sql"},
                  auth(key) if key else None)
    e = error(a, 403)
    assert e["code"] == "permission_denied" and e["type"] == "permission_error"
    assert "admin" in e["message"]
    assert len(stub.handles[CHAT].calls) == calls  # no replica was asked


def test_an_admin_loads_an_adapter_that_its_tenant_alone_may_use(
        stub: StubIngress, roots: dict[str, Path]) -> None:
    h = stub.handles[CHAT]
    path = roots["allowed"] / "acme-ft"
    a = load(stub, "acme-ft", path)
    assert a.status == 200, a.body
    assert a.body == {"object": "lora_adapter", "id": "acme-ft", "parent": CHAT,
                      "status": "loaded", "message": a.body["message"]}
    ((kind, name, sent_path, int_id),) = [c for c in h.calls if c[1] == "acme-ft"]
    assert (kind, name, sent_path) == ("load", "acme-ft", os.path.realpath(path))
    assert 0 < int_id < 2**63  # drawn for this registration; requests carry the same
    # Its tenant uses it; another tenant with a list without it, and the free tier, may not.
    ok = stub.post("/v1/chat/completions", chat("acme-ft"), auth(ACME))
    assert ok.status == 200 and ok.body["model"] == "acme-ft"
    assert h.sent[-1].lora == LoRARequest("acme-ft", int_id, os.path.realpath(path))
    for key in (LAB, FREE):
        e = error(stub.post("/v1/chat/completions", chat("acme-ft"), auth(key)), 404)
        assert "acme-ft' does not" in e["message"] and e["message"].count("acme-ft") == 1
    assert "acme-ft" in [m["id"] for m in stub.get("/v1/models", auth(ACME)).body["data"]]
    assert "acme-ft" not in [m["id"] for m in stub.get("/v1/models", auth(LAB)).body["data"]]
    # A key without a list (the tier's own) may use it, as it may every model.
    assert stub.post("/v1/chat/completions", chat("acme-ft"), auth(PAID)).status == 200
    # Loading it again from the same path: a no-op 200; from another path: 400.
    again = load(stub, "acme-ft", path)
    assert again.status == 200 and again.body["status"] == "already_loaded"
    assert len([c for c in h.calls if c[1] == "acme-ft"]) == 1
    e = error(load(stub, "acme-ft", roots["allowed"] / "acme-v2"), 400)
    assert e["code"] == "lora_adapter_exists" and "unload it first" in e["message"]


def test_an_adapter_loaded_for_tenants_is_theirs_alone(stub: StubIngress,
                                                        roots: dict[str, Path]) -> None:
    """With ``tenants``, only those tenants' keys may use or see it: another key of the same
    tier without a list (here the admin's own), the free tier and the anonymous tier get the
    404 of a model that does not exist, and their listings do not show it."""
    h = stub.handles[CHAT]
    a = load(stub, "paid-own", roots["allowed"] / "three", tenants=["paid-key1"])
    assert a.status == 200, a.body
    ok = stub.post("/v1/chat/completions", chat("paid-own"), auth(PAID))
    assert ok.status == 200 and ok.body["model"] == "paid-own"
    assert h.sent[-1].lora is not None and h.sent[-1].lora.lora_name == "paid-own"
    assert "paid-own" in [m["id"] for m in stub.get("/v1/models", auth(PAID)).body["data"]]
    assert stub.get("/v1/models/paid-own", auth(PAID)).status == 200
    for key in (ADMIN, FREE, None):
        headers = auth(key) if key else None
        e = error(stub.post("/v1/chat/completions", chat("paid-own"), headers), 404)
        assert e["code"] == "model_not_found" and e["message"].count("paid-own") == 1
        assert "paid-own" not in [m["id"] for m in stub.get("/v1/models", headers).body["data"]]
        assert error(stub.get("/v1/models/paid-own", headers), 404)["code"] == "model_not_found"
    # The same name for other owners is another adapter: unload it first.
    e = error(load(stub, "paid-own", roots["allowed"] / "three"), 400)
    assert e["code"] == "lora_adapter_exists"
    again = load(stub, "paid-own", roots["allowed"] / "three", tenants=["paid-key1"])
    assert again.status == 200 and again.body["status"] == "already_loaded"
    assert unload(stub, "paid-own").status == 200


def test_owners_count_only_a_tenant_its_key_identifies(stub: StubIngress) -> None:
    """A tenant only claimed (the tenant header, or no tenant) is never an owner."""
    from tierserve.cluster.adapters import Adapter
    from tierserve.cluster.tiers import Caller

    owned = Adapter("x", CHAT, "/a/x", 7, tenants=("acme",))
    tier = stub.inst.cfg.tiers[0]
    may = stub.inst._may_use_adapter
    assert may(Caller(tier, 5, tenant="acme", keyed=True), owned)
    assert not may(Caller(tier, 5, tenant="acme"), owned)  # claimed by a header
    assert not may(Caller(tier, 5, tenant="lab", keyed=True), owned)
    # The allowlist holds besides: an owner whose list lacks it may not use it.
    assert not may(Caller(tier, 5, tenant="acme", keyed=True, models=frozenset([CHAT])), owned)


@pytest.mark.parametrize(("tenants", "needle"), [
    (["nobody"], "not a tenant"), ([], "at least one"), ("acme", "valid list"),
    (["acme", 3], "valid string")])
def test_a_load_s_tenants_must_be_tenants_a_key_identifies(
        stub: StubIngress, roots: dict[str, Path], tenants: Any, needle: str) -> None:
    calls = len(stub.handles[CHAT].calls)
    e = error(load(stub, "owned", roots["allowed"] / "one", tenants=tenants), 400)
    assert needle in e["message"] and e["param"].startswith("tenants")
    assert len(stub.handles[CHAT].calls) == calls  # no replica was asked
    assert "owned" not in stub.inst.adapters.dynamic


def test_open_tiers_are_named_at_start(roots: dict[str, Path]) -> None:
    """The start's warning names the tiers whose callers have no list (the paid tier's own
    keys here); with a list everywhere, none."""
    from tierserve.cluster.adapters import open_tiers

    assert open_tiers(load_config(config(roots))) == ["paid"]
    cfg = config(roots)
    cfg["tiers"][0]["models"] = [CHAT, "tiny", "sql", "acme-ft"]
    assert open_tiers(load_config(cfg)) == []
    cfg["tiers"][0].pop("models")
    cfg["tiers"][0]["api_keys"] = []
    cfg["admin_keys"] = []
    assert open_tiers(load_config(cfg)) == []  # only tenants with lists
    cfg["tiers"][1].pop("models")
    cfg["tiers"][1]["api_keys"] = []
    assert open_tiers(load_config(cfg)) == ["free"]  # the anonymous tier, even without keys


def test_an_adapter_a_replica_cannot_load_is_sent_to_another(stub: StubIngress) -> None:
    """A replica's 503 ``adapter_unavailable`` (it could not read the adapter at request time)
    sends the request to another replica, the refusing one avoided."""
    h = stub.handles[CHAT]
    h.refuse.append(ErrorRecord(503, "adapter_unavailable",
                                "LoRA adapter 'sql' is not available on this replica",
                                replica="replica-1"))
    a = stub.post("/v1/chat/completions", chat("sql"), auth(PAID))
    assert a.status == 200 and a.body["model"] == "sql"
    assert h.sent[-1].avoid_replicas == ("replica-1",) and not h.refuse


@pytest.mark.parametrize(("path", "code"), [
    ("empty", "invalid_lora_adapter"),  # the replica refuses: not PEFT
    ("missing", "invalid_lora_adapter"),  # the replica refuses: no such folder
    ("wide", "invalid_lora_adapter"),  # the replica refuses: rank above max_lora_rank
])
def test_a_bad_adapter_gets_the_replica_s_refusal_and_is_not_registered(
        stub: StubIngress, roots: dict[str, Path], path: str, code: str) -> None:
    name = f"bad-{path}"
    e = error(load(stub, name, roots["allowed"] / path), 400)
    assert e["code"] == code and name in e["message"]
    assert error(stub.get(f"/v1/models/{name}", auth(PAID)), 404)["code"] == "model_not_found"
    assert name not in stub.inst.adapters.dynamic


@pytest.mark.parametrize("where", ["outside", "symlink", "dotdot", "relative"])
def test_a_path_outside_the_roots_is_refused_before_any_replica_is_asked(
        stub: StubIngress, roots: dict[str, Path], where: str) -> None:
    path = {"outside": str(roots["outside"] / "stray"),
            "symlink": str(roots["allowed"] / "link"),
            "dotdot": str(roots["allowed"] / ".." / "elsewhere" / "stray"),
            "relative": "adapters/one"}[where]
    calls = len(stub.handles[CHAT].calls)
    e = error(load(stub, f"stray-{where}", path), 400)
    assert e["code"] == "lora_path_not_allowed" and e["param"] == "lora_path"
    assert len(stub.handles[CHAT].calls) == calls


@pytest.mark.parametrize(("name", "code"), [
    (CHAT, "lora_name_taken"), ("tiny", "lora_name_taken"), ("sql", "lora_name_taken"),
    ("no spaces", "invalid_request"), ("", "invalid_request")])
def test_an_adapter_name_is_not_a_model_s_nor_taken(stub: StubIngress, roots: dict[str, Path],
                                                     name: str, code: str) -> None:
    e = error(load(stub, name, roots["allowed"] / "one"), 400)
    assert e["code"] == code and e["param"] == "lora_name"


def test_the_parent_model_must_take_adapters(stub: StubIngress, roots: dict[str, Path]) -> None:
    e = error(load(stub, "one", roots["allowed"] / "one", model="tiny"), 400)
    assert e["code"] == "lora_disabled" and CHAT in e["message"]
    e = error(load(stub, "one", roots["allowed"] / "one", model="nosuch"), 404)
    assert e["code"] == "model_not_found"
    e = error(stub.post("/v1/load_lora_adapter", {"lora_name": "one"}, auth(ADMIN)), 400)
    assert e["param"] == "lora_path"


def test_unload_refuses_a_static_or_unknown_adapter(stub: StubIngress) -> None:
    e = error(unload(stub, "sql"), 400)
    assert e["code"] == "static_lora_adapter"
    e = error(unload(stub, "never-loaded"), 404)
    assert e["code"] == "lora_not_found"
    assert stub.post("/v1/chat/completions", chat("sql"), auth(PAID)).status == 200


def test_unload_forgets_it_and_unloads_it_from_the_replicas(
        stub: StubIngress, roots: dict[str, Path]) -> None:
    h = stub.handles[CHAT]
    assert load(stub, "gone", roots["allowed"] / "gone").status == 200
    assert "gone" in h.loras
    a = unload(stub, "gone")
    assert a.status == 200 and a.body["status"] == "unloaded" and a.body["parent"] == CHAT
    assert "gone" not in h.loras and ("unload", "gone") in h.calls
    e = error(stub.post("/v1/chat/completions", chat("gone"), auth(PAID)), 404)
    assert e["code"] == "model_not_found"
    assert "gone" not in [m["id"] for m in stub.get("/v1/models", auth(PAID)).body["data"]]
    assert error(unload(stub, "gone"), 404)["code"] == "lora_not_found"
    # Loaded again (from the same path), it is another registration: another id.
    assert load(stub, "gone", roots["allowed"] / "gone").status == 200
    ids = [c[3] for c in h.calls if c[:2] == ("load", "gone")]
    assert len(ids) == 2 and ids[0] != ids[1]
    assert stub.post("/v1/chat/completions", chat("gone"), auth(PAID)).status == 200
    assert h.sent[-1].lora is not None and h.sent[-1].lora.lora_int_id == ids[1]
    assert unload(stub, "gone").status == 200


def test_unload_of_an_adapter_in_use_leaves_the_registry_without_it(
        stub: StubIngress, roots: dict[str, Path]) -> None:
    h = stub.handles[CHAT]
    assert load(stub, "busy", roots["allowed"] / "busy").status == 200
    h.busy.add("busy")
    try:
        a = unload(stub, "busy")
        assert a.status == 200 and "still run requests on it" in a.body["message"]
        assert "busy" in h.loras  # the replica keeps it until its requests end
        assert "busy" not in stub.inst.adapters.dynamic
        assert error(stub.post("/v1/chat/completions", chat("busy"), auth(PAID)),
                     404)["code"] == "model_not_found"
    finally:
        h.busy.discard("busy")
        h.loras.pop("busy", None)


def test_at_most_max_dynamic_loras_at_once(roots: dict[str, Path]) -> None:
    one = StubIngress({"engine": {"model": CHAT, "max_model_len": 512, "enable_lora": True},
                       "served_model_name": "base", "max_dynamic_loras": 1,
                       "tiers": [{"name": "t", "base_priority": 0, "max_priority": 0,
                                  "api_keys": [ADMIN]}],
                       "anonymous_tier": None, "admin_keys": [ADMIN]})
    # One model with enable_lora: the parent by default; no path roots: any absolute path.
    a = load(one, "one", roots["outside"] / "stray")
    assert a.status == 200 and a.body["parent"] == "base"
    e = error(load(one, "two", roots["allowed"] / "two"), 400)
    assert e["code"] == "too_many_lora_adapters" and "max_dynamic_loras (1)" in e["message"]
    assert [c[1] for c in one.handle.calls] == ["one"]  # no replica asked for the second
    assert unload(one, "one").status == 200
    assert load(one, "two", roots["allowed"] / "two").status == 200


def test_requests_are_counted_per_adapter(stub: StubIngress,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, str, str]] = []
    monkeypatch.setattr(stub.inst.metrics, "adapter_request",
                        lambda model, adapter, tier: seen.append((model, adapter, tier)))
    stub.post("/v1/chat/completions", chat("sql"), auth(PAID))
    stub.post("/v1/chat/completions", chat(CHAT), auth(PAID))
    stub.post("/v1/chat/completions", chat("sql"), auth(FREE))  # refused: not counted
    assert seen == [(CHAT, "sql", "paid")]


def test_the_adapter_label_is_bounded(stub: StubIngress) -> None:
    m = stub.inst.metrics
    counted: list[str] = []
    real = m.counters["tierserve_adapter_requests"]

    class Spy:
        def inc(self, n: int, tags: dict[str, str]) -> None:
            counted.append(tags["adapter"])

    m.counters["tierserve_adapter_requests"] = Spy()
    try:
        for i in range(10):
            m.adapter_request(CHAT, f"churn-{i}", "paid")
        m.adapter_request(CHAT, "sql", "paid")
    finally:
        m.counters["tierserve_adapter_requests"] = real
    assert counted[-1] == "sql"  # a static name is always its own
    assert len(set(counted)) <= 1 + 3 + 1  # the static, max_dynamic_loras, _other
    assert "_other" in counted


# ------------------------------------------------------------------ the registry, without HTTP


def test_dynamic_adapters_rules() -> None:
    d = DynamicAdapters(max_dynamic=2, reserved=["base", "sql"])
    a = d.add("x", "base", "/a/x", 77)
    assert (a.int_id, a.static, a.key, d.version) == (77, False, "x#77", 1)
    assert d.add("x", "base", "/a/x", 78) == a and d.version == 1  # the same: a no-op, its id
    with pytest.raises(BadRequest, match="another path"):
        d.add("x", "base", "/a/y", 79)
    with pytest.raises(BadRequest, match="other tenants"):
        d.add("x", "base", "/a/x", 79, ("acme",))
    with pytest.raises(BadRequest, match="share one namespace"):
        d.add("sql", "base", "/a/sql", 80)
    d.add("y", "base", "/a/y", 81)
    with pytest.raises(BadRequest, match="max_dynamic_loras"):
        d.add("z", "base", "/a/z", 82)
    assert d.remove("x") == a
    with pytest.raises(NotFound):
        d.remove("x")
    # A name unloaded comes back from any path, as another registration (its own id): the
    # replicas and their prefix caches key it by name and id, never mixing the two.
    again = d.add("x", "base", "/a/other", 83, ("acme",))
    assert (again.int_id, again.tenants, again.key) == (83, ("acme",), "x#83")
    # The actor's class answers refusals as records (an exception would come back wrapped).
    actor = AdapterStoreActor(1, ["base"])
    got = actor.add("base", "base", "/a", 5)
    assert isinstance(got, ErrorRecord) and got.code == "lora_name_taken"
    assert isinstance(actor.remove("nope"), ErrorRecord)


def test_lora_ids() -> None:
    """A static id is the same wherever it is computed, positive and 63-bit, and differs with
    the name or the path; dynamic ids are drawn anew each time."""
    from tierserve.cluster.adapters import new_lora_id

    one = static_lora_id("sql", "/a/sql")
    assert one == static_lora_id("sql", "/a/sql") and 0 < one < 2**63
    assert len({one, static_lora_id("sql", "/a/sql2"), static_lora_id("sq", "l/a/sql")}) == 3
    drawn = {new_lora_id() for _ in range(64)}
    assert len(drawn) == 64 and all(0 < i < 2**63 for i in drawn)
    assert LoRARequest("a", 9, "/p").key == "a#9"


def test_check_path(tmp_path: Path) -> None:
    (tmp_path / "in" / "a").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    os.symlink(tmp_path / "out", tmp_path / "in" / "esc")
    root = [str(tmp_path / "in")]
    assert check_path(str(tmp_path / "in" / "a"), root) == os.path.realpath(tmp_path / "in" / "a")
    for bad in (str(tmp_path / "out"), str(tmp_path / "in" / "esc"),
                str(tmp_path / "in" / ".." / "out"), "in/a", "", str(tmp_path) + "/in-x"):
        with pytest.raises(BadRequest):
            check_path(bad, root)
    assert check_path(str(tmp_path / "out"), []) == os.path.realpath(tmp_path / "out")


def test_a_copy_reads_the_store_again_on_a_miss(roots: dict[str, Path]) -> None:
    """Two ingress replicas' registries over one store: a load through one is seen by the
    other on its next lookup of that name; an unload, once its copy is stale."""
    cfg = load_config(config(roots))
    models = cfg.served_models()
    store = LocalStore(DynamicAdapters(4, [CHAT, "tiny", "sql"]))
    first = AdapterRegistry(models, store, path_roots=[str(roots["allowed"])], ttl_s=3600.0)
    second = AdapterRegistry(models, store, path_roots=[str(roots["allowed"])], ttl_s=3600.0,
                             miss_s=0.0)

    async def ok(_: Any) -> None:
        return None

    async def run() -> None:
        assert await second.lookup("three") is None
        added, new = await first.load("three", str(roots["allowed"] / "three"), None, ok)
        assert new and added.parent == CHAT
        assert await second.lookup("three") == added
        await first.unload("three")
        assert await second.lookup("three") == added  # its copy is fresh yet
        second.read_at = float("-inf")  # its ttl passed
        assert await second.lookup("three") is None

    asyncio.run(run())


class SlowStore(LocalStore):
    """A store whose reads take a while (an actor call) and are counted; ``fail`` makes the
    next reads fail as an unreachable actor does."""

    def __init__(self, state: DynamicAdapters) -> None:
        super().__init__(state)
        self.reads = 0
        self.fail = False

    async def snapshot(self) -> Any:
        self.reads += 1
        await asyncio.sleep(0.05)
        if self.fail:
            raise Unavailable("the LoRA adapter registry cannot be reached; try again",
                              "adapter_registry_unavailable")
        return await super().snapshot()


def test_made_up_names_read_the_store_at_most_once_per_miss_s(roots: dict[str, Path]) -> None:
    """50 lookups of made-up names at once share one read (the refresh is single-flight);
    more at once after it, and listings, read nothing until ``miss_s`` has passed."""
    store = SlowStore(DynamicAdapters(4, [CHAT, "tiny", "sql"]))
    reg = AdapterRegistry(load_config(config(roots)).served_models(), store, ttl_s=3600.0,
                          miss_s=3600.0)

    async def run() -> None:
        got = await asyncio.gather(*(reg.lookup(f"made-up-{i}") for i in range(50)))
        assert got == [None] * 50 and store.reads == 1
        got = await asyncio.gather(*(reg.lookup(f"again-{i}") for i in range(50)),
                                   *(reg.fresh() for _ in range(10)))
        assert store.reads == 1
        assert await reg.lookup("sql") is not None  # a static one: never a read
        # A lookup cancelled while it waits does not cancel the read the others share.
        reg.read_at = float("-inf")
        waiters = [asyncio.ensure_future(reg.lookup(f"late-{i}")) for i in range(5)]
        await asyncio.sleep(0)
        waiters[0].cancel()
        assert await asyncio.gather(*waiters[1:]) == [None] * 4 and store.reads == 2
        # A failed read fails every lookup that shared it, once.
        store.fail, reg.read_at = True, float("-inf")
        failed = await asyncio.gather(*(reg.lookup(f"down-{i}") for i in range(10)),
                                      return_exceptions=True)
        assert all(isinstance(e, Unavailable) for e in failed) and store.reads == 3

    asyncio.run(run())


def test_a_refusal_during_the_replica_s_load_registers_nothing(roots: dict[str, Path]) -> None:
    reg = AdapterRegistry(load_config(config(roots)).served_models(), max_dynamic=4,
                          path_roots=[str(roots["allowed"])])

    async def refuse(_: Any) -> None:
        raise ServingError("not a PEFT adapter", "invalid_lora_adapter", status=400)

    async def run() -> None:
        with pytest.raises(ServingError) as e:
            await reg.load("spent", str(roots["allowed"] / "spent"), CHAT, refuse)
        assert e.value.status == 400
        assert await reg.lookup("spent") is None

    asyncio.run(run())


# ------------------------------------------------------------------ the config


def test_a_static_adapter_may_not_take_a_model_s_name(roots: dict[str, Path]) -> None:
    cfg = config(roots)
    cfg["models"][0]["engine"]["lora_modules"] = [{"name": "tiny", "path": "/x"}]
    with pytest.raises(ValueError, match="share one namespace"):
        load_config(cfg)


def test_allowlists_may_name_adapters_only_where_a_model_takes_them(
        roots: dict[str, Path]) -> None:
    cfg = config(roots)
    cfg["tiers"][1]["models"] = [CHAT, "sql", "loaded-later"]
    load_config(cfg)  # a static adapter, and a name an admin may load
    plain = {"models": [{"name": "tiny", "engine": {"model": TINY}}],
             "tiers": [{"name": "t", "base_priority": 0, "max_priority": 0,
                        "models": ["tiny", "typo"]}], "anonymous_tier": "t"}
    with pytest.raises(ValueError, match="not served models"):
        load_config(plain)


def test_an_admin_key_must_be_a_tier_s_key(roots: dict[str, Path]) -> None:
    cfg = load_config(config(roots, admin_keys=["sk-nobody"]))
    with pytest.raises(ValueError, match=r"admin_keys\.0 is not one of the tiers' api_keys"):
        TierResolver(cfg)
    resolver = TierResolver(load_config(config(roots)))
    assert resolver.resolve(f"Bearer {ADMIN}", None).admin
    assert not resolver.resolve(f"Bearer {PAID}", None).admin
    assert not resolver.resolve(None, None).admin
    assert resolver.shifted(resolver.resolve(f"Bearer {ADMIN}", None), 1).admin



def test_a_caller_is_keyed_only_by_a_valid_key(roots: dict[str, Path]) -> None:
    """``Caller.keyed`` (what adapter ownership counts): a key's tenant, through a priority or
    service tier it asks for; never a caller without a key."""
    resolver = TierResolver(load_config(config(roots)))
    acme = resolver.resolve(f"Bearer {ACME}", None)
    assert acme.keyed and acme.tenant == "acme"
    assert resolver.resolve(f"Bearer {PAID}", None).tenant == "paid-key1"
    assert resolver.shifted(acme, 1).keyed
    assert resolver.for_service_tier(acme, "flex", False)[0].keyed
    assert resolver.for_service_tier(acme, "priority", False)[0].keyed
    assert not resolver.resolve(None, None).keyed


# ------------------------------------------------------------------ the OpenAPI document


def test_the_openapi_document_has_the_adapter_routes(stub: StubIngress) -> None:
    doc = stub.inst.openapi_doc
    for path, errors in (("/v1/load_lora_adapter", {"400", "403", "404", "503"}),
                         ("/v1/unload_lora_adapter", {"400", "403", "404"})):
        op = doc["paths"][path]["post"]
        assert errors <= set(op["responses"]) and "200" in op["responses"]
        assert "permission_denied" in op["responses"]["403"]["description"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "LoRAAdapterRequest")
    card = doc["components"]["schemas"]["ModelCard"]["properties"]
    assert {"parent", "root"} <= set(card)
    # Adapters may be named as the model: no enum of the served models' names.
    assert "enum" not in json.dumps(doc["components"]["schemas"]["CompletionRequest"][
        "properties"]["model"])


def test_a_name_loaded_again_from_other_weights_is_another_adapter(
        stub: StubIngress, roots: dict[str, Path]) -> None:
    """After an unload a name may come back from another path: a new id, so its requests carry
    another key and their prefix hashes are not the old weights' (the replicas key adapters and
    their blocks by name and id)."""
    h = stub.handles[CHAT]
    hashes = []
    for folder in ("spent", "one"):
        assert load(stub, "spent", roots["allowed"] / folder).status == 200
        a = stub.post("/v1/completions", {"model": "spent", "prompt": LONG, "max_tokens": 1},
                      auth(PAID))
        assert a.status == 200
        sent = h.sent[-1]
        assert sent.lora is not None and sent.lora.lora_path == os.path.realpath(
            roots["allowed"] / folder)
        hashes.append((sent.lora.key, sent.prefix_hashes))
        assert unload(stub, "spent").status == 200
    (key1, old), (key2, new) = hashes
    assert key1 != key2 and old and new and not set(old) & set(new)


def test_a_load_the_store_refuses_after_the_replica_took_it_leaves_nothing_reachable(
        roots: dict[str, Path]) -> None:
    """Two ingress replicas load one name from two paths at once: the second to register is
    refused by the store; the copy its replica loaded has an id that no request carries."""
    models = load_config(config(roots)).served_models()
    store = LocalStore(DynamicAdapters(4, [CHAT, "tiny", "sql"]))
    reg = AdapterRegistry(models, store, path_roots=[str(roots["allowed"])])
    validated: list[int] = []

    async def meanwhile(adapter: Any) -> None:  # the other ingress registers it meanwhile
        validated.append(adapter.int_id)
        store.state.add("two", CHAT, os.path.realpath(roots["allowed"] / "one"), 12345)

    async def run() -> None:
        with pytest.raises(BadRequest, match="another path"):
            await reg.load("two", str(roots["allowed"] / "two"), CHAT, meanwhile)
        assert await reg.lookup("two") is not None

    asyncio.run(run())
    entry = reg.dynamic["two"]
    assert entry.path == os.path.realpath(roots["allowed"] / "one")
    assert entry.int_id == 12345 and validated[0] != 12345


def test_a_failed_read_after_a_load_or_unload_is_not_the_answer(
        roots: dict[str, Path]) -> None:
    """The store took the load (or unload): a read of it failing afterwards is logged, and
    this ingress's copy has the change anyway."""
    store = SlowStore(DynamicAdapters(4, [CHAT, "tiny", "sql"]))
    reg = AdapterRegistry(load_config(config(roots)).served_models(), store, ttl_s=3600.0,
                          miss_s=3600.0)
    ids: list[int] = []

    async def ok(adapter: Any) -> None:
        ids.append(adapter.int_id)

    async def run() -> None:
        await reg.refresh()
        store.fail = True
        entry, new = await reg.load("three", str(roots["allowed"] / "three"), CHAT, ok)
        assert new and entry.int_id == ids[0] and await reg.lookup("three") == entry
        assert (await reg.unload("three")).int_id == ids[0]
        assert await reg.lookup("three") is None
        assert store.state.snapshot() == (2, [])

    asyncio.run(run())


def test_load_inplace_and_relative_roots_are_refused(stub: StubIngress,
                                                     roots: dict[str, Path]) -> None:
    e = error(load(stub, "one", roots["allowed"] / "one", load_inplace=True), 400)
    assert e["param"] == "load_inplace" and "new name" in e["message"]
    with pytest.raises(ValueError, match="must be absolute"):
        load_config(config(roots, lora_path_roots=["adapters"]))
