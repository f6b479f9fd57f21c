"""The application builder that ``serve run configs/cluster.yaml`` imports.

``build_app(args)`` validates the config's ``args`` (``tierserve.cluster.config.ClusterConfig``) and binds the
engine deployment (``LLMServer``, one replica per GPU or CPU slice) behind the ``Ingress``; with a
``models`` list, one engine deployment per model (``LLMServer`` for the first, ``LLMServer-<name>``
for the others unless a model names its ``deployment``), all behind the one ``Ingress``. Serve's
own per-deployment options (replicas, resources, the router) come from the YAML's ``deployments``,
each entry by its deployment's name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from pydantic import ValidationError
from ray.serve import Application, Deployment

from tierserve.cluster.config import ClusterConfig, deployment_of
from tierserve.cluster.ingress import Ingress
from tierserve.replica.config import describe
from tierserve.replica.deployment import LLMDeployment
from tierserve.router.routing import RouterSettings


class ConfigError(ValueError):
    """The application's ``args`` are not a valid tierserve config."""


BUILDER = "tierserve.cluster.app:build_app"
POLICY = "tierserve.cluster.autoscaling:TierPolicy"
ROUTER = "tierserve.router.free_blocks_router:FreeKVBlocksRouter"


def _lines(e: ValidationError, prefix: tuple[str, ...] = ()) -> str:
    return "  " + describe(e, prefix, "\n  ")


def load_config(args: dict[str, Any] | None) -> ClusterConfig:
    try:
        return ClusterConfig(**(args or {}))
    except ValidationError as e:
        raise ConfigError("invalid tierserve config:\n" + _lines(e)) from None


def check_serve_config(raw: Mapping[str, Any]) -> None:
    """A whole Serve config file, checked before anything starts (``tierserve serve`` does):
    Serve's own schema, then, for each application this package builds, its ``args``, the
    ``policy_kwargs`` of an ``autoscaling_config`` that uses tierserve's policy and the
    ``request_router_kwargs`` of a deployment routed by tierserve's router. Raises
    ``ConfigError`` naming each field at fault."""
    from ray.serve.schema import ServeDeploySchema

    from tierserve.cluster.autoscaling import AutoscalePolicyConfig

    try:
        ServeDeploySchema.model_validate(raw)
    except ValidationError as e:
        raise ConfigError("invalid Serve config:\n" + _lines(e)) from None
    for i, app in enumerate(raw.get("applications") or []):
        if app.get("import_path") != BUILDER:
            continue
        cfg = load_config(app.get("args"))
        names = deployment_names(cfg)
        for dep in app.get("deployments") or []:
            if dep.get("name") not in names:
                raise ConfigError(
                    f"applications.{i}.deployments: {dep.get('name')!r} is not a deployment of "
                    f"this application (its deployments: {names}); a model's engine deployment "
                    "is `LLMServer` for the first model, `LLMServer-<name>` for the others, or "
                    "its `deployment`")
            router = dep.get("request_router_config") or {}
            if router.get("request_router_class") == ROUTER:
                try:
                    RouterSettings.from_kwargs(router.get("request_router_kwargs") or {})
                except ValueError as e:
                    raise ConfigError(
                        f"invalid router settings (applications.{i}.deployments."
                        f"{dep.get('name')}.request_router_config.request_router_kwargs): "
                        f"{e}") from None
            policy = (dep.get("autoscaling_config") or {}).get("policy") or {}
            if policy.get("policy_function") != POLICY:
                continue
            try:
                AutoscalePolicyConfig(**(policy.get("policy_kwargs") or {}))
            except ValidationError as e:
                where = ("applications", str(i), "deployments", str(dep.get("name")),
                         "autoscaling_config", "policy", "policy_kwargs")
                raise ConfigError("invalid autoscaling policy:\n" + _lines(e, where)) from None


def deployment_names(cfg: ClusterConfig) -> list[str]:
    """The application's deployments: each served model's engine deployment, then ``Ingress``."""
    return [deployment_of(m, i) for i, m in enumerate(cfg.served_models())] + ["Ingress"]


def build_app(args: dict[str, Any] | None = None) -> Application:
    cfg = load_config(args)
    tiers = [t.name for t in cfg.tiers]
    llms = [LLMDeployment.options(name=deployment_of(m, i)).bind(
                engine=m.engine.model_dump(), fault_injection=cfg.fault_injection, tiers=tiers)
            for i, m in enumerate(cfg.served_models())]
    return cast(Deployment, Ingress).bind(llms[0] if cfg.models is None else llms,
                                          ingress_args(cfg))


def ingress_args(cfg: ClusterConfig) -> dict[str, Any]:
    """``cfg`` as the ``Ingress`` takes it: plain data, the keys' references as written (the
    ingress resolves them in its own process), a ``models`` config without the one-model
    fields it replaces."""
    one_model = {"engine", "served_model_name", "tool_call_parser"} if cfg.models else set()
    return cfg.model_dump(mode="python", exclude={"tiers", "admin_keys"} | one_model) | {
        "tiers": [t.model_dump() | {
            "api_keys": [k.get_secret_value() for k in t.api_keys],
            "tenants": [n.model_dump() | {"api_keys": [k.get_secret_value() for k in n.api_keys]}
                        for n in t.tenants]}
                  for t in cfg.tiers],
        "admin_keys": [k.get_secret_value() for k in cfg.admin_keys],
    }
