"""The shipped configs are valid for Serve and for tierserve."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from tierserve.cluster.app import POLICY, check_serve_config, deployment_names, load_config

ROOT = Path(__file__).resolve().parents[2] / "configs"
CPU, GPU = ROOT / "cluster.yaml", ROOT / "cluster-gpu.yaml"
CPU_ONE = ROOT / "cpu-one-replica.yaml"
AUTOSCALE = ROOT / "cluster-autoscale.yaml"
GEMMA3 = ROOT / "cluster-gemma3.yaml"
MULTI = ROOT / "cluster-multi.yaml"
CONFIGS = [CPU, GPU, CPU_ONE, AUTOSCALE, GEMMA3, MULTI]


def test_every_config_in_configs_is_checked() -> None:
    """Each Serve config shipped in configs/ is one of those ``test_config_is_valid`` checks."""
    assert sorted(ROOT.glob("*.yaml")) == sorted(CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_is_valid(path: Path) -> None:
    raw = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.parse_obj(raw)
    app = schema.applications[0]
    cfg = load_config(app.args)
    names = {d.name for d in app.deployments}
    assert names == set(deployment_names(cfg))  # every model's engine deployment, the ingress
    for name in names - {"Ingress"}:
        llm = next(d for d in app.deployments if d.name == name)
        assert llm.request_router_config is not None, name
    assert all(m.engine.model for m in cfg.served_models())
    check_serve_config(raw)


def test_the_multi_model_config_serves_smollm2_and_gemma_on_a_cpu_replica_each() -> None:
    raw = yaml.safe_load(MULTI.read_text())
    cfg = load_config(raw["applications"][0]["args"])
    assert [(m.name, m.engine.model) for m in cfg.served_models()] == [
        ("smollm2-135m-instruct", "smollm2-135m-instruct"), ("gemma-3-270m", "gemma-3-270m")]
    assert deployment_names(cfg) == ["LLMServer", "LLMServer-gemma-3-270m", "Ingress"]
    for dep in raw["applications"][0]["deployments"]:
        if dep["name"] != "Ingress":
            assert dep["num_replicas"] == 1 and dep["ray_actor_options"] == {"num_cpus": 1}
    # ``make serve CONFIG=...`` installs and prepares both (``prepare --install --config``).
    from tierserve.replica.models.prepare import config_models

    assert config_models(raw) == ["smollm2-135m-instruct", "gemma-3-270m"]


def test_autoscaling_is_one_block_of_the_default_config() -> None:
    """configs/cluster-autoscale.yaml is the default config with the engine deployment's
    ``num_replicas`` replaced by an ``autoscaling_config`` on tierserve's policy (and Serve's
    graceful shutdown given time to finish what a replica holds)."""
    cpu, auto = (yaml.safe_load(p.read_text()) for p in (CPU, AUTOSCALE))
    llm = {c: next(d for d in raw["applications"][0]["deployments"] if d["name"] == "LLMServer")
           for c, raw in (("cpu", cpu), ("auto", auto))}
    scaling = llm["auto"].pop("autoscaling_config")
    assert llm["cpu"].pop("num_replicas") == scaling["max_replicas"] == 2
    assert scaling["min_replicas"] == 1
    assert scaling["policy"]["policy_function"] == POLICY
    assert scaling["upscale_delay_s"] == scaling["downscale_delay_s"] == 0
    assert llm["auto"].pop("graceful_shutdown_timeout_s") >= 30
    llm["auto"].pop("graceful_shutdown_wait_loop_s")
    assert llm["auto"] == llm["cpu"]
    for raw in (cpu, auto):
        raw["applications"][0]["deployments"] = [
            d for d in raw["applications"][0]["deployments"] if d["name"] != "LLMServer"]
    assert cpu == auto
    # Serve builds the policy from its kwargs, as its controller will.
    from tierserve.cluster.autoscaling import TierPolicy

    assert TierPolicy(**scaling["policy"]["policy_kwargs"]).params.downscale_after_s == 60


def test_default_config_binds_loopback_and_runs_two_cpu_replicas() -> None:
    raw = yaml.safe_load(CPU.read_text())
    assert raw["http_options"]["host"] == "127.0.0.1"
    llm = next(d for d in raw["applications"][0]["deployments"] if d["name"] == "LLMServer")
    assert llm["num_replicas"] == 2 and "num_gpus" not in llm["ray_actor_options"]
    assert raw["applications"][0]["args"]["engine"]["model"] == "smollm2-135m-instruct"


def test_make_install_installs_the_default_models_package() -> None:
    """The Makefile pins the same package the catalog names (and with --no-deps)."""
    from tierserve.replica.models.catalog import DEFAULT_MODEL, PACKAGED

    makefile = (CPU.parents[1] / "Makefile").read_text()
    assert f"MODEL_PKG  ?= {PACKAGED[DEFAULT_MODEL].requirement}" in makefile
    assert '--no-deps "$(MODEL_PKG)"' in makefile
    # ... and then builds its prepared cache, so that a replica's first start reads it
    assert f"PREPARE    ?= {DEFAULT_MODEL}" in makefile
    install = makefile.index('--no-deps "$(MODEL_PKG)"')
    prepare = makefile.index("$(PY) -m tierserve.replica.models.prepare $(PREPARE)")
    assert install < prepare < makefile.index("@touch $(STAMP)")
    assert makefile.index("endif", makefile.index("$(STAMP):")) < install  # CPU and GPU alike


def test_one_replica_config_differs_from_the_default_only_in_its_layout() -> None:
    """The same model and engine as the default; one replica with the CPUs of both, and the KV
    memory of both."""
    cpu, one = (yaml.safe_load(p.read_text()) for p in (CPU, CPU_ONE))
    llm = {c: next(d for d in raw["applications"][0]["deployments"] if d["name"] == "LLMServer")
           for c, raw in (("cpu", cpu), ("one", one))}
    assert llm["one"]["num_replicas"] == 1
    assert llm["one"]["ray_actor_options"]["num_cpus"] == (
        llm["cpu"]["num_replicas"] * llm["cpu"]["ray_actor_options"]["num_cpus"])
    engine = {c: raw["applications"][0]["args"]["engine"] for c, raw in (("cpu", cpu), ("one", one))}
    assert engine["one"].pop("kv_cache_memory_bytes") == (
        llm["cpu"]["num_replicas"] * engine["cpu"].pop("kv_cache_memory_bytes"))
    assert engine["one"] == engine["cpu"]


def test_gpu_config_puts_one_replica_per_gpu() -> None:
    raw = yaml.safe_load(GPU.read_text())
    llm = next(d for d in raw["applications"][0]["deployments"] if d["name"] == "LLMServer")
    assert llm["ray_actor_options"]["num_gpus"] == 1
    assert raw["applications"][0]["args"]["engine"]["attention_backend"] == "triton"


def _config_rows() -> dict[str, str]:
    """``args`` field -> its default cell, from the configuration table of docs/config.md."""
    text = (ROOT.parent / "docs" / "config.md").read_text()
    table = text[text.index("| `args` field | default | meaning |"):]
    rows: dict[str, str] = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("| `"):
            break
        field, default = (c.strip() for c in line.strip("|").split("|")[:2])
        rows[field.strip("`")] = default
    return rows


def _cell(value: object) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"`{value}`"
    return str(value)


def test_the_config_reference_lists_exactly_the_engine_configs_fields_and_defaults() -> None:
    from tierserve.replica.config import EngineConfig

    rows = {k.removeprefix("engine."): v for k, v in _config_rows().items()
            if k.startswith("engine.")}
    fields = EngineConfig.model_fields
    assert list(rows) == list(fields), "docs/config.md's engine rows, in the config's order"
    for name, info in fields.items():
        assert rows[name] == _cell(info.default), name


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"saturation_wait": 3}, "unknown request_router_kwargs ['saturation_wait']"),
    ({"balance_rel": 0.5}, "request_router_kwargs): invalid request_router_kwargs for "
                           "FreeKVBlocksRouter: balance_rel: Input should be greater than or equal to 1"),
    ({"prefix_index_blocks": "many"}, "prefix_index_blocks: Input should be a valid integer"),
])
def test_the_routers_settings_are_checked_before_anything_starts(
        kwargs: dict[str, object], says: str) -> None:
    """``tierserve serve`` refuses router settings the router would refuse once deployed,
    naming where they are and the field at fault."""
    from tierserve.cluster.app import ConfigError

    raw = yaml.safe_load(CPU.read_text())
    llm = next(d for d in raw["applications"][0]["deployments"] if d["name"] == "LLMServer")
    llm["request_router_config"]["request_router_kwargs"] = kwargs
    with pytest.raises(ConfigError) as e:
        check_serve_config(raw)
    assert "applications.0.deployments.LLMServer.request_router_config" in str(e.value)
    assert says in str(e.value)
    llm["request_router_config"]["request_router_kwargs"] = {"balance_rel": 2.0, "seed": 1}
    check_serve_config(raw)


def test_the_docs_hold_the_reference_the_config_models_make() -> None:
    """Each field's meaning is written once, on the field: docs/config.md, docs/tiers.md and
    docs/autoscaling.md hold exactly the tables ``tierserve.cluster.reference`` makes of the
    models (after a change: ``python -m tierserve.cluster.reference --write``)."""
    from tierserve.cluster.reference import held, tables

    for table in tables():
        text = (ROOT.parent / table.doc).read_text()
        assert held(text, table.header) == table.markdown(), (
            f"{table.doc}'s table is stale: run python -m tierserve.cluster.reference --write")
    paths = [f for t in tables() for f, _, _ in t.rows]
    assert "engine.max_num_seqs" in paths and "flow.max_hold_s" in paths
    assert "structured_limits.max_depth" in paths and "tenants[].weight" in paths


def test_every_config_field_says_what_it_does() -> None:
    from pydantic import BaseModel

    from tierserve.cluster.reference import rows

    class Undocumented(BaseModel):
        knob: int = 3

    with pytest.raises(ValueError, match=r"Undocumented\.knob has no description"):
        list(rows(Undocumented))


def test_the_environment_holds_only_what_the_docs_table_lists() -> None:
    """Every ``TIERSERVE_*`` variable the runtime reads is a row of docs/config.md's
    environment table, and every row is read: the rest is set in the config's fields."""
    import re

    from tierserve.cluster.reference import held, tables

    repo = ROOT.parent
    read: set[str] = set()
    for part in ("cluster", "replica", "router", "kernels", "tierserve"):
        for path in (repo / part).rglob("*.py"):
            if part == "tierserve" and path.parent.name != "tierserve":
                continue  # the links to the parts, walked above
            read |= set(re.findall(r"\bTIERSERVE_[A-Z_]+\b", path.read_text()))
    table = held((repo / "docs" / "config.md").read_text(), "| variable | default |")
    listed = set(re.findall(r"^\| `(TIERSERVE_[A-Z_]+)` \|", table, re.M))
    assert read == listed
    fields = {f.upper() for t in tables() for f, _, _ in t.rows}
    assert not {v.removeprefix("TIERSERVE_") for v in listed} & fields  # no second way


def test_the_gemma3_config_is_the_default_config_serving_gemma() -> None:
    """configs/cluster-gemma3.yaml differs from the default config in its model alone."""
    cpu, gemma = (yaml.safe_load(p.read_text()) for p in (CPU, GEMMA3))
    engine = gemma["applications"][0]["args"]["engine"]
    assert engine.pop("model") == "gemma-3-270m"
    cpu["applications"][0]["args"]["engine"].pop("model")
    assert gemma == cpu
