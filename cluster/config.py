"""The cluster's configuration: the application ``args`` of ``configs/cluster.yaml``, validated.

Serve's own keys (replicas, resources, the router class, back-pressure) stay in the YAML's
``deployments`` section, where Serve reads them; everything tierserve reads is here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from tierserve.cluster.structured import SchemaLimits
from tierserve.cluster.tool_calls import check_tool_format
from tierserve.records import MAX_STOP_STRINGS
from tierserve.replica.config import EngineConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class TenantConfig(_Strict):
    """A tenant of a tier: its name (in metrics), its weight in the tier's fair share (a tenant
    of weight 2 gets twice the tokens of one of weight 1 while both are backlogged) and the API
    keys that identify it (written as a tier's ``api_keys`` are)."""

    name: str = Field(
        pattern=TENANT_NAME,
        description="the tenant's name: 1 to 64 letters, digits, `.`, `_` or `-`, starting with a "
                    "letter or digit")
    weight: float = Field(
        default=1.0, gt=0.0, le=1000.0,
        description="its share of its tier against the tier's other tenants (Virtual Token Counter "
                    "weights)")
    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="its keys, written as a tier's are")
    models: list[str] | None = Field(
        default=None,
        description="the served model (or LoRA adapter) names its keys may use (within its "
                    "tier's `models`); `null`: all its tier may use "
                    "([security.md](docs/security.md))")


class TierConfig(_Strict):
    """A priority tier: callers with one of ``api_keys`` (or, for the anonymous tier, no
    key). Each field's meaning is its ``description`` (docs/tiers.md's table is made from
    them)."""

    name: str = Field(
        pattern=r"^[a-z][a-z0-9_-]{0,31}$",
        description="the tier's name: lowercase letters, digits, `_` and `-`, at most 32")
    base_priority: int = Field(
        ge=-1000, le=1000,
        description="the priority of a request that asks for none")
    max_priority: int = Field(
        ge=-1000, le=1000,
        description="the highest priority the `X-TL-Priority` header may ask for")
    queue_share: float = Field(
        default=1.0, gt=0.0, le=1.0,
        description="the fraction of a replica's waiting queue, and of the ingress's dispatch "
                    "window, the tier may fill: lower tiers get smaller shares, so under overload "
                    "they wait and are refused first")
    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="its callers' keys (`Authorization: Bearer <key>`), each written literally, as "
                    "`env:VAR` (the variable's value in the ingress's process) or `file:PATH` (the "
                    "file's content, stripped); use the references for real keys: Serve logs an "
                    "application's `args`")
    ttft_target_s: float | None = Field(
        default=None, gt=0.0, le=3600.0,
        description="the time to first token it promises")
    tpot_target_s: float | None = Field(
        default=None, gt=0.0, le=60.0,
        description="the time per output token (after the first) it promises; the replicas' "
                    "SLO-aware steps keep it")
    max_held: int = Field(
        default=256, ge=0,
        description="its requests the ingress may hold while no replica can start them; beyond, "
                    "shed")
    late_after_s: float = Field(
        default=30.0, gt=0.0, le=3600.0,
        description="how long one of its requests may be held before it is *late* (best below "
                    "`ttft_target_s`): a late request yields to every on-time one, and is shed "
                    "only while newer requests of its tier or above are held behind it, or to make "
                    "room in a full queue")
    max_stream_bytes: int = Field(
        default=256 << 20, gt=0, json_schema_extra={"doc_default": "256 MiB"},
        description="the bytes its open streams may have sent, all together (Ray Serve's proxy "
                    "keeps what a client has not read); beyond, its new requests get 429 "
                    "`stream_budget` until streams end ([security.md](docs/security.md))")
    tenants: list[TenantConfig] = Field(
        default_factory=list,
        description="named tenants, each `{name, weight, api_keys}` (the `tiers[].tenants[].*` "
                    "fields); each key of the tier's own `api_keys` is a tenant of its own "
                    "(`<tier>-key<N>`, weight 1)")
    models: list[str] | None = Field(
        default=None,
        description="the served model names its callers may use (keys and anonymous callers "
                    "alike); any other model is a 404 `model_not_found` to them and is not in "
                    "their `/v1/models`; LoRA adapters are named here as models are "
                    "([lora.md](docs/lora.md)); `null`: every model, and every adapter but "
                    "one an admin loaded for other `tenants` ([security.md](docs/security.md))")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "held_ttl_s" in data:
            raise ValueError("held_ttl_s is now late_after_s: a request held longer is late "
                             "(it yields to on-time requests), no longer refused on a timer")
        return data

    @model_validator(mode="after")
    def _ordered(self) -> TierConfig:
        if self.max_priority < self.base_priority:
            raise ValueError(
                f"tier {self.name!r}: max_priority ({self.max_priority}) is below base_priority "
                f"({self.base_priority})"
            )
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tier {self.name!r}: tenant names must be unique, got {names}")
        reserved = [n for n in names if n.startswith(f"{self.name}-key")]
        if reserved:
            raise ValueError(f"tier {self.name!r}: tenant names {reserved} are reserved for the "
                             f"keys of api_keys ({self.name}-key<N>)")
        return self

    def all_keys(self) -> list[tuple[str, str]]:
        """(tenant name, key reference) of every key of this tier."""
        keys = [(f"{self.name}-key{i}", k.get_secret_value()) for i, k in enumerate(self.api_keys)]
        return keys + [(t.name, k.get_secret_value()) for t in self.tenants for k in t.api_keys]

    def weight_of(self, tenant: str) -> float:
        return next((t.weight for t in self.tenants if t.name == tenant), 1.0)

    def models_of(self, tenant: str) -> frozenset[str] | None:
        """The models ``tenant`` of this tier may use: its own list (a configured tenant's)
        within the tier's; None: every model."""
        own = next((t.models for t in self.tenants if t.name == tenant), None)
        if own is not None:
            return frozenset(own)
        return frozenset(self.models) if self.models is not None else None


def _default_tiers() -> list[TierConfig]:
    """The default config's tiers and targets (sized for SmolLM2-135M on a CPU core, where a
    lone request's time per output token is about 25 ms and its p99 about 50 ms)."""
    return [
        TierConfig(name="interactive", base_priority=10, max_priority=15, queue_share=1.0,
                   ttft_target_s=3.0, tpot_target_s=0.1, max_held=256, late_after_s=10.0),
        TierConfig(name="standard", base_priority=5, max_priority=9, queue_share=0.8,
                   ttft_target_s=15.0, tpot_target_s=0.5, max_held=256, late_after_s=10.0),
        TierConfig(name="batch", base_priority=0, max_priority=4, queue_share=0.5,
                   ttft_target_s=60.0, max_held=128, late_after_s=40.0),
    ]


class FlowConfig(_Strict):
    """Flow control at the ingress (``cluster/flow.py``; docs/tiers.md). Each field's
    meaning is its ``description``."""

    enabled: bool = Field(
        default=True,
        description="flow control at the ingress (see [tiers.md](docs/tiers.md)): hold requests no "
                    "replica can start, fair between tenants, shed the lowest tier first; false "
                    "sends every request straight to a replica")
    starting_per_replica: int = Field(
        default=8, ge=1, le=4096,
        description="requests dispatched to a replica that have not answered their first token, "
                    "per replica (the dispatch window; a tier dispatches while those it counts "
                    "fill less than its `queue_share` of it, under priority scheduling only its "
                    "own and the higher tiers' requests, so all tiers together may pass it)")
    max_held: int = Field(
        default=1024, ge=0,
        description="requests held at the ingress at most, all tiers (a full queue sheds a late "
                    "request of the lowest tier at or below the arrival's, else evicts the newest "
                    "held request of the lowest tier below it)")
    max_hold_s: float = Field(
        default=300.0, gt=0.0, le=86400.0,
        description="the longest any request is held, late or not (a client that leaves sooner is "
                    "dropped at once)")
    shed_status: Literal[429, 503] = Field(
        default=429,
        description="the status of a shed request: 429 or 503, with a `Retry-After` estimated from "
                    "how fast the gate has started its tier's requests lately (at least "
                    "`retry_after_s`, at most 60 s)")
    tenant_header: str | None = Field(
        default=None, pattern=r"^[A-Za-z0-9-]{1,64}$",
        description="a header that names the tenant inside the caller's tier (for a gateway that "
                    "authenticates upstream); `null`: tenants are API keys")
    aging_s: float | None = Field(
        default=20.0, gt=0.0,
        description="a request held longer goes ahead of higher tiers (the oldest first), for at "
                    "most `flow.aged_share` of the dispatches: no tier starves, and under overload "
                    "the lower tiers still absorb it; `null`: strict priority")
    aged_share: float = Field(
        default=0.05, ge=0.0, le=1.0,
        description="the most of the dispatches aged requests may take")
    tenant_burst_s: float = Field(
        default=0.0, ge=0.0, le=3600.0,
        description="a tenant coming back from idle to a tier whose other tenants are backlogged "
                    "first catches up what it missed in the last this many seconds (its burst goes "
                    "ahead of them while a higher tier leaves its tier short, at the cost of the "
                    "backlogged tenants' shares over that span); 0: the plain Virtual Token "
                    "Counter, idle time banks nothing")


# A served model's name (what clients send as ``model``): visible ASCII without spaces, so it is a
# safe metric label and URL path segment; a deployment's name as Serve's YAML writes it.
MODEL_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$"
DEPLOYMENT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
# The engine deployment of the first (or only) model; the others are ``LLMServer-<name>``.
FIRST_DEPLOYMENT = "LLMServer"


class ModelConfig(_Strict):
    """One model the application serves (``models[]``): the name clients send, its own
    engine deployment and its engine settings. Each field's meaning is its ``description``."""

    name: str = Field(
        pattern=MODEL_NAME,
        description="the `model` name clients send: 1 to 128 letters, digits and `._:/@+-`, "
                    "starting with a letter or digit")
    engine: EngineConfig = Field(
        default_factory=EngineConfig, json_schema_extra={"doc_default": "`engine.*`'s"},
        description="its replicas' engine: the `engine.*` fields")
    deployment: str | None = Field(
        default=None, pattern=DEPLOYMENT_NAME,
        json_schema_extra={"doc_default": "`LLMServer` (first), `LLMServer-<name>`"},
        description="the name of its engine deployment, which the YAML's `deployments` entry of "
                    "the same name configures (replicas or autoscaling, resources, router); "
                    "`null`: `LLMServer` for the first model, `LLMServer-<name>` for the others "
                    "(a name with characters a deployment may not have must set one)")
    tool_call_parser: str | None = Field(
        default=None,
        description="its tool-call format, as the top-level `tool_call_parser`")
    max_tokens_limit: int | None = Field(
        default=None, gt=0,
        description="its own largest `max_tokens` (and chat's default); `null`: the top-level "
                    "`max_tokens_limit`")

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, name: str | None) -> str | None:
        return None if name is None else check_tool_format(name)


class ClusterConfig(_Strict):
    """The whole application's settings (the config file's ``args``). Each field's meaning
    is its ``description`` (docs/config.md's table is made from them,
    ``tierserve.cluster.reference``)."""

    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="one replica's engine: the `engine.*` fields (the same fields `LLM(**options)` "
                    "takes)")
    served_model_name: str | None = Field(
        default=None, json_schema_extra={"doc_default": "`engine.model`"},
        description="the `model` name clients send")
    tool_call_parser: str | None = Field(
        default=None,
        description="the format of the model's tool calls, by vLLM's `--tool-call-parser` "
                    "names: `hermes` (`<tool_call>` JSON), `llama3_json` (Llama 3.x's JSON "
                    "calls), `mistral` (`[TOOL_CALLS]`); `null`: picked from the chat "
                    "template's markers, `hermes` without any ([api.md](docs/api.md), tool "
                    "calling)")
    tiers: list[TierConfig] = Field(
        default_factory=_default_tiers,
        min_length=1,
        json_schema_extra={"doc_default": "interactive / standard / batch"},
        description="the priority tiers, highest first by `base_priority` (see docs/tiers.md: the "
                    "`tiers[].*` fields)")
    anonymous_tier: str | None = Field(
        default="standard",
        description="the tier of a request without an API key (without keys configured, every "
                    "request's); `null` makes keys mandatory; with keys it may not rank above any "
                    "keyed tier (the config check refuses it)")
    max_request_bytes: int = Field(
        default=1 << 20, gt=0, json_schema_extra={"doc_default": "1 MiB"},
        description="larger bodies get 413")
    body_timeout_s: float = Field(
        default=30.0, gt=0.0, le=3600.0,
        description="a body not all received this long after its headers gets 408")
    max_tokenize_chars: int = Field(
        default=1 << 18, gt=0, json_schema_extra={"doc_default": "262144"},
        description="the most characters `/tokenize` counts in one request (a prompt, or the "
                    "messages' texts); beyond, 400 `too_long`: it bounds the work and the answer "
                    "(about 14 times the text with `return_token_strs`) one request holds")
    max_tokens_limit: int = Field(
        default=4096, gt=0,
        description="the largest `max_tokens` a request may ask for (and the default for chat)")
    max_stop_strings: int = Field(
        default=8, ge=0, le=MAX_STOP_STRINGS,
        description="the most `stop` strings per request (at most 64)")
    retry_after_s: int = Field(
        default=1, ge=0,
        description="the least `Retry-After` of a 429 (flow control estimates more when a tier "
                    "starts its held requests slowly)")
    replica_retries: int = Field(
        default=2, ge=0, le=10,
        description="times a request is sent again when its replica fails before any of its answer "
                    "went out")
    max_inflight_requests: int = Field(
        default=1024, gt=0,
        description="requests in flight through the ingress at most (a tier may use its "
                    "`queue_share` of them); beyond, 429 at once")
    max_n: int = Field(
        default=8, ge=1, le=128,
        description="the most samples (`n`) one request may ask for")
    fault_injection: bool = Field(
        default=False,
        description="lets `LLMServer.inject_fault` break a replica (fault tests only)")
    prefix_cache_scope: Literal["tenant", "shared"] = Field(
        default="tenant",
        description="a prompt's cached blocks are shared only within its tenant (and "
                    "`cache_salt`), so `cached_tokens` never tells one tenant about another's "
                    "prompts; `shared`: across tenants ([security.md](docs/security.md))")
    structured_limits: SchemaLimits = Field(
        default_factory=SchemaLimits,
        description="what the ingress takes in a request's JSON schemas "
                    "(`tierserve.cluster.structured.SchemaLimits`: sizes, properties, subschemas, "
                    "depth, enums, bounds, tools); beyond a limit, 400 `invalid_structured_output` "
                    "naming the limit's field (docs/structured.md): the `structured_limits.*` "
                    "fields")
    flow: FlowConfig = Field(
        default_factory=FlowConfig,
        description="flow control at the ingress: the `flow.*` fields")
    models: list[ModelConfig] | None = Field(
        default=None, min_length=1,
        description="several models in one application, each `{name, engine, deployment, "
                    "tool_call_parser, max_tokens_limit}` (the `models[].*` fields), each on "
                    "its own engine deployment, routed by the request's `model`; instead of "
                    "`engine`, `served_model_name` and `tool_call_parser` (both at once is an "
                    "error); `null`: the one model of `engine`")
    admin_keys: list[SecretStr] = Field(
        default_factory=list,
        description="the API keys that may also load and unload LoRA adapters "
                    "(`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`), written as a tier's "
                    "`api_keys` are (literal, `env:VAR`, `file:PATH`); each must be one of a "
                    "tier's keys too (it is served in that tier); a request without a key is never "
                    "an admin's ([lora.md](docs/lora.md))")
    lora_path_roots: list[str] = Field(
        default_factory=list,
        description="the (absolute) directories an admin's `/v1/load_lora_adapter` may name an "
                    "adapter folder in (the path resolved, symlinks and `..` followed, must lie inside one); "
                    "empty: any absolute path ([security.md](docs/security.md))")
    max_dynamic_loras: int = Field(
        default=64, ge=0, le=4096,
        description="the most adapters loaded at run time at once (all models); one more is a 400 "
                    "`too_many_lora_adapters` until one is unloaded")

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, name: str | None) -> str | None:
        return None if name is None else check_tool_format(name)

    @field_validator("lora_path_roots")
    @classmethod
    def _absolute_roots(cls, roots: list[str]) -> list[str]:
        relative = [r for r in roots if not os.path.isabs(r)]
        if relative:
            raise ValueError(f"lora_path_roots must be absolute directories, got {relative}")
        return roots

    @field_validator("tiers")
    @classmethod
    def _unique(cls, tiers: list[TierConfig]) -> list[TierConfig]:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        keys = [k for t in tiers for _, k in t.all_keys()]
        if len(set(keys)) != len(keys):
            raise ValueError("an API key is listed in more than one tier")
        return tiers

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "default_tier" in data:
            raise ValueError(
                "default_tier is now anonymous_tier: the tier of a request without an API key. "
                "With keys configured it may not rank above any tier that has keys (null: a key "
                "is required)")
        return data

    @model_validator(mode="after")
    def _models(self) -> ClusterConfig:
        if self.models is not None:
            both = sorted({"engine", "served_model_name", "tool_call_parser"}
                          & self.model_fields_set)
            if both:
                raise ValueError(
                    f"models and {', '.join(both)} are both set: with a `models` list, each "
                    "model's engine, name and tool_call_parser go in its entry (models[].engine, "
                    "models[].name, models[].tool_call_parser)")
        served = self.served_models()
        names = [m.name for m in served]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"models: names must be unique, {dup} is listed more than once")
        for i, m in enumerate(served):
            if m.deployment is None and not re.fullmatch(DEPLOYMENT_NAME, deployment_of(m, i)):
                raise ValueError(
                    f"models.{i}: {m.name!r} cannot name a deployment "
                    f"({deployment_of(m, i)!r}: letters, digits, `._-` only): set its "
                    "`deployment`")
        deps = [deployment_of(m, i) for i, m in enumerate(served)]
        dup = sorted({d for d in deps if deps.count(d) > 1})
        if dup:
            raise ValueError(f"models: deployment names must be unique, {dup} is used more "
                             "than once")
        if "Ingress" in deps:
            raise ValueError("models: `Ingress` is the ingress's deployment: name the model's "
                             "deployment otherwise")
        known = set(names)
        # An allowlist may name adapters too: the static ones, and (where a model takes
        # adapters) names an admin may load at run time, which no config check can know.
        adapters = {a.name for m in served for a in m.engine.lora_modules or ()}
        clash = sorted(adapters & known)
        if clash:
            raise ValueError(f"lora_modules adapters {clash} have served models' names: "
                             "adapters and models share one namespace")
        known |= adapters
        dynamic = any(m.engine.enable_lora for m in served)
        for t in self.tiers:
            lists = [(f"tier {t.name!r} models", t.models)] + [
                (f"tier {t.name!r} tenant {n.name!r} models", n.models) for n in t.tenants]
            for where, allowed in lists:
                unknown = [m for m in allowed or () if m not in known]
                if unknown and not dynamic:
                    raise ValueError(f"{where}: {unknown} are not served models (the served "
                                     f"ones: {names})")
            for n in t.tenants:
                outside = [m for m in n.models or () if t.models is not None
                           and m not in t.models]
                if outside:
                    raise ValueError(
                        f"tier {t.name!r} tenant {n.name!r} models: {outside} are not in its "
                        f"tier's models {t.models}: a tenant's list narrows its tier's")
        return self

    @model_validator(mode="after")
    def _anonymous_tier(self) -> ClusterConfig:
        tiers = {t.name: t for t in self.tiers}
        anon = tiers.get(self.anonymous_tier) if self.anonymous_tier is not None else None
        if self.anonymous_tier is not None and anon is None:
            raise ValueError(
                f"anonymous_tier {self.anonymous_tier!r} is not one of the tiers {list(tiers)}")
        keyed = [t for t in self.tiers if t.all_keys()]
        if anon is None and not keyed:
            raise ValueError(
                "anonymous_tier is null (an API key is required) but no tier has api_keys: no "
                "request could ever be served; add keys or name an anonymous tier"
            )
        if anon is not None:
            above = [t.name for t in keyed if t is not anon and (
                anon.base_priority > t.base_priority or anon.max_priority > t.max_priority)]
            if above:
                raise ValueError(
                    f"anonymous_tier {anon.name!r} (priorities {anon.base_priority} to "
                    f"{anon.max_priority}) ranks above the keyed tier(s) {above}: a caller "
                    "would raise its tier by dropping its key; name the lowest tier, a tier of "
                    "its own below every keyed one, or null (a key is required)")
        return self

    @property
    def model_name(self) -> str:
        """The first (or only) model's served name."""
        return self.served_models()[0].name

    def served_models(self) -> list[ModelConfig]:
        """Every model the application serves, in order: ``models``, or the one model of
        ``engine`` (named ``served_model_name``, else ``engine.model``)."""
        if self.models is not None:
            return list(self.models)
        # Not validated again: ``engine.model`` may be a path, which a ``models[].name`` may
        # not be, and the fields were checked as this config's own.
        return [ModelConfig.model_construct(
            name=self.served_model_name or self.engine.model, engine=self.engine,
            deployment=FIRST_DEPLOYMENT, tool_call_parser=self.tool_call_parser,
            max_tokens_limit=None)]

    @property
    def latency_floor(self) -> int:
        """The top tier's ``base_priority``: requests at or above it are routed for their first
        token (``GenerateRequest.latency``), the others for room and balance."""
        return max(t.base_priority for t in self.tiers)


def deployment_of(model: ModelConfig, index: int) -> str:
    """The engine deployment's name of the ``index``-th served model (``ModelConfig.
    deployment``)."""
    if model.deployment is not None:
        return model.deployment
    return FIRST_DEPLOYMENT if index == 0 else f"{FIRST_DEPLOYMENT}-{model.name}"


def resolve_key(ref: str) -> str:
    """The key an ``api_keys`` entry stands for (see ``TierConfig``). Raises ``ValueError`` for a
    missing variable, an unreadable file or an empty key, without showing any key."""
    if ref.startswith("env:"):
        name = ref[4:]
        value = os.environ.get(name)
        if value is None:
            raise ValueError(f"API key reference {ref!r}: environment variable {name!r} is not set")
    elif ref.startswith("file:"):
        try:
            value = Path(ref[5:]).expanduser().read_text()
        except OSError as e:
            raise ValueError(f"API key reference {ref!r}: cannot read the file ({e.strerror})") from None
    else:
        value = ref
    value = value.strip()
    if not value:
        raise ValueError(f"API key {ref!r} is empty" if ref.startswith(("env:", "file:"))
                         else "an API key is empty")
    return value
