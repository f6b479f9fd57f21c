"""The application builder that ``serve run configs/cluster.yaml`` imports.

``build_app(args)`` validates the config's ``args`` (``tierserve.cluster.config.ClusterConfig``) and binds the
engine deployment (``LLMServer``, one replica per GPU or CPU slice) behind the ``Ingress``. Serve's
own per-deployment options (replicas, resources, the router) come from the YAML's ``deployments``.
"""

from __future__ import annotations

from typing import Any, cast

from pydantic import ValidationError
from ray.serve import Application, Deployment

from tierserve.cluster.config import ClusterConfig
from tierserve.cluster.ingress import Ingress
from tierserve.replica.deployment import LLMDeployment


class ConfigError(ValueError):
    """The application's ``args`` are not a valid tierserve config."""


def load_config(args: dict[str, Any] | None) -> ClusterConfig:
    try:
        return ClusterConfig(**(args or {}))
    except ValidationError as e:
        lines = [f"  {'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}" for err in e.errors()]
        raise ConfigError("invalid tierserve config:\n" + "\n".join(lines)) from None


def build_app(args: dict[str, Any] | None = None) -> Application:
    cfg = load_config(args)
    engine = cfg.engine.model_dump()
    llm = LLMDeployment.bind(engine=engine, fault_injection=cfg.fault_injection,
                             tiers=[t.name for t in cfg.tiers])
    return cast(Deployment, Ingress).bind(llm, cfg.model_dump(mode="python", exclude={"tiers"}) | {
        "tiers": [t.model_dump() | {
            "api_keys": [k.get_secret_value() for k in t.api_keys],
            "tenants": [n.model_dump() | {"api_keys": [k.get_secret_value() for k in n.api_keys]}
                        for n in t.tenants]}
                  for t in cfg.tiers]
    })
