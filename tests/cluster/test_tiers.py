"""Tiers: keys map to tiers in constant time, the header never lifts a caller above its tier."""

from __future__ import annotations

from typing import Any

import pytest

from tierserve.cluster.config import ClusterConfig, TierConfig, resolve_key
from tierserve.cluster.tiers import AuthError, PriorityError, TierResolver


def resolver(anonymous: str | None = "batch") -> TierResolver:
    cfg = ClusterConfig(
        tiers=[
            TierConfig(name="interactive", base_priority=10, max_priority=15, api_keys=["k-int"]),
            TierConfig(name="standard", base_priority=5, max_priority=9, api_keys=["k-std"]),
            TierConfig(name="batch", base_priority=0, max_priority=4, queue_share=0.5,
                       api_keys=["k-batch"]),
        ],
        anonymous_tier=anonymous,
    )
    return TierResolver(cfg)


def test_key_selects_its_tier_and_base_priority() -> None:
    c = resolver().resolve("Bearer k-int", None)
    assert (c.tier.name, c.priority) == ("interactive", 10)


def test_no_key_gets_the_anonymous_tier() -> None:
    c = resolver().resolve(None, None)
    assert (c.tier.name, c.priority) == ("batch", 0)


def test_no_key_without_an_anonymous_tier_is_401() -> None:
    with pytest.raises(AuthError, match="needs an API key"):
        resolver(anonymous=None).resolve(None, None)
    for empty in ("", "Bearer ", "Bearer  "):
        with pytest.raises(AuthError):
            resolver(anonymous=None).resolve(empty, None)


@pytest.mark.parametrize("anonymous", ["interactive", "standard"])
def test_an_anonymous_tier_above_a_keyed_tier_is_refused(anonymous: str) -> None:
    """Dropping a key must never raise a caller's tier: with keys on every tier the anonymous
    tier can only be the lowest (the hole: keys everywhere, no key answered in 'standard')."""
    with pytest.raises(ValueError, match=f"anonymous_tier {anonymous!r} .* ranks above the keyed "
                                         r"tier\(s\) \[.*'batch'\]"):
        resolver(anonymous=anonymous)


def test_an_anonymous_tier_of_its_own_below_the_keyed_ones_is_accepted() -> None:
    cfg = ClusterConfig(tiers=[
        TierConfig(name="paid", base_priority=5, max_priority=9, api_keys=["k-paid"]),
        TierConfig(name="free", base_priority=0, max_priority=0),
    ], anonymous_tier="free")
    r = TierResolver(cfg)
    assert r.resolve(None, None).tier.name == "free"
    assert r.resolve("Bearer k-paid", None).tier.name == "paid"
    # A max_priority above a keyed tier's ranks above it too.
    with pytest.raises(ValueError, match="ranks above"):
        ClusterConfig(tiers=[
            TierConfig(name="paid", base_priority=5, max_priority=9, api_keys=["k-paid"]),
            TierConfig(name="free", base_priority=0, max_priority=10),
        ], anonymous_tier="free")


def test_the_old_default_tier_field_is_refused_with_its_new_name() -> None:
    with pytest.raises(ValueError, match="default_tier is now anonymous_tier"):
        ClusterConfig(default_tier="standard")  # type: ignore[call-arg]


@pytest.mark.parametrize("header", ["Bearer nope", "Basic k-int", "Bearer ", "k-int"])
def test_bad_keys_are_refused(header: str) -> None:
    with pytest.raises(AuthError):
        resolver().resolve(header, None)


def test_header_chooses_within_the_tier() -> None:
    assert resolver().resolve("Bearer k-batch", "3").priority == 3


@pytest.mark.parametrize("value", ["10", "15", "5", "-1"])
def test_batch_key_cannot_ask_for_more(value: str) -> None:
    with pytest.raises(PriorityError, match="outside what tier 'batch' allows"):
        resolver().resolve("Bearer k-batch", value)


@pytest.mark.parametrize("value", ["high", "1.5", "0x10", "9" * 40 + "x"])
def test_non_integer_priority_is_a_clear_error(value: str) -> None:
    with pytest.raises(PriorityError, match="must be an integer"):
        resolver().resolve(None, value)


def test_the_top_tiers_requests_are_routed_for_their_first_token() -> None:
    """What the router treats as latency-sensitive comes from the tiers, not a mirrored number."""
    r = resolver()
    assert r.resolve("Bearer k-int", None).latency
    assert not r.resolve("Bearer k-std", "9").latency
    assert not r.resolve("Bearer k-batch", None).latency
    top = TierConfig(name="gold", base_priority=40, max_priority=50, api_keys=["k-gold"])
    other = TierConfig(name="interactive", base_priority=10, max_priority=45, api_keys=["k-i"])
    custom = TierResolver(ClusterConfig(tiers=[top, other], anonymous_tier=None))
    assert custom.resolve("Bearer k-gold", None).latency
    assert not custom.resolve("Bearer k-i", "10").latency
    assert custom.resolve("Bearer k-i", "40").latency


def test_keys_are_not_in_the_config_repr() -> None:
    cfg = ClusterConfig(tiers=[TierConfig(name="a", base_priority=0, max_priority=1, api_keys=["sekrit"])],
                        anonymous_tier=None)
    assert "sekrit" not in repr(cfg) and "sekrit" not in str(cfg.model_dump())


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"tiers": [{"name": "a", "base_priority": 5, "max_priority": 1}]}, "below base_priority"),
        ({"anonymous_tier": "gold"}, "not one of the tiers"),
        ({"default_tier": "standard"}, "default_tier is now anonymous_tier"),
        ({"tiers": [{"name": "a", "base_priority": 0, "max_priority": 1},
                    {"name": "a", "base_priority": 0, "max_priority": 1}], "anonymous_tier": "a"},
         "unique"),
        ({"engine": {"block_size": 7}}, "block_size"),
        ({"engine": {"scheduling_policy": "lifo"}}, "scheduling_policy"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_bad_config_is_refused_with_a_clear_message(args: dict[str, object], match: str) -> None:
    from tierserve.cluster.app import ConfigError, load_config

    with pytest.raises(ConfigError, match=match):
        load_config(args)


def test_keys_can_be_environment_variables_or_files(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("TS_KEY_A", " from-env \n")
    (tmp_path / "key").write_text("from-file\n")
    assert resolve_key("env:TS_KEY_A") == "from-env"
    assert resolve_key(f"file:{tmp_path / 'key'}") == "from-file"
    assert resolve_key("literal") == "literal"
    cfg = ClusterConfig(tiers=[
        TierConfig(name="a", base_priority=0, max_priority=1, api_keys=["env:TS_KEY_A"]),
        TierConfig(name="b", base_priority=2, max_priority=3, api_keys=[f"file:{tmp_path / 'key'}"]),
    ], anonymous_tier=None)
    resolver = TierResolver(cfg)
    assert resolver.resolve("Bearer from-env", None).tier.name == "a"
    assert resolver.resolve("Bearer from-file", None).tier.name == "b"
    with pytest.raises(AuthError):
        resolver.resolve("Bearer env:TS_KEY_A", None)  # the reference itself is no key


@pytest.mark.parametrize(("ref", "match"), [
    ("env:TS_NOT_SET_ANYWHERE", "environment variable 'TS_NOT_SET_ANYWHERE' is not set"),
    ("file:/nonexistent/key", "cannot read the file"),
    ("env:TS_EMPTY", "is empty"),
])
def test_a_bad_key_reference_is_a_clear_error(ref: str, match: str, monkeypatch: Any) -> None:
    monkeypatch.setenv("TS_EMPTY", "  ")
    with pytest.raises(ValueError, match=match):
        resolve_key(ref)


def test_two_references_to_one_key_are_refused(monkeypatch: Any) -> None:
    monkeypatch.setenv("TS_K1", "same")
    monkeypatch.setenv("TS_K2", "same")
    cfg = ClusterConfig(tiers=[
        TierConfig(name="a", base_priority=0, max_priority=1, api_keys=["env:TS_K1"]),
        TierConfig(name="b", base_priority=2, max_priority=3, api_keys=["env:TS_K2"]),
    ], anonymous_tier=None)
    with pytest.raises(ValueError, match="more than once"):
        TierResolver(cfg)


@pytest.mark.parametrize("auth", [None, "Bearer unused-without-keys", "Bearer sk-123", "Basic x",
                                  "garbage"])
def test_without_any_key_configured_every_authorization_is_ignored(auth: str | None) -> None:
    """The ``openai`` SDK always sends a key: on a server with no keys it must not matter."""
    open_server = TierResolver(ClusterConfig())
    c = open_server.resolve(auth, "7")
    assert (c.tier.name, c.priority) == ("standard", 7)
    with pytest.raises(PriorityError):
        open_server.resolve(auth, "12")  # the priority header still has the tier's bounds


def test_keys_configured_an_unknown_key_is_still_401() -> None:
    with pytest.raises(AuthError, match="not valid"):
        resolver().resolve("Bearer unused-without-keys", None)


def test_a_mandatory_key_with_no_keys_anywhere_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="no tier has api_keys"):
        ClusterConfig(anonymous_tier=None)


# ---------------------------------------------------------------- tenants


def tenant_resolver() -> TierResolver:
    from tierserve.cluster.config import TenantConfig

    cfg = ClusterConfig(tiers=[
        TierConfig(name="interactive", base_priority=10, max_priority=15, api_keys=["k-int"]),
        TierConfig(name="standard", base_priority=5, max_priority=9, api_keys=["k-std"],
                   tenants=[TenantConfig(name="acme", weight=3.0, api_keys=["k-acme"])]),
    ])
    return TierResolver(cfg)


def test_a_key_names_its_tenant_and_weight() -> None:
    r = tenant_resolver()
    acme = r.resolve("Bearer k-acme", None)
    assert (acme.tier.name, acme.tenant, acme.weight) == ("standard", "acme", 3.0)
    plain = r.resolve("Bearer k-std", None)
    assert (plain.tier.name, plain.tenant, plain.weight) == ("standard", "standard-key0", 1.0)
    # A key's tenant wins over the header.
    assert r.resolve("Bearer k-acme", None, "someone").tenant == "acme"


def test_the_tenant_header_names_the_tenant_of_a_keyless_caller() -> None:
    r = tenant_resolver()
    assert r.resolve(None, None).tenant == "default"
    c = r.resolve(None, None, " team-7 ")
    assert (c.tenant, c.weight) == ("team-7", 1.0)


@pytest.mark.parametrize("claimed", ["acme", "standard-key0"])
def test_the_header_cannot_claim_a_tenant_that_a_key_identifies(claimed: str) -> None:
    from tierserve.cluster.tiers import TenantError

    with pytest.raises(TenantError, match="identified by its API key"):
        tenant_resolver().resolve(None, None, claimed)


def test_a_keyless_named_tenant_takes_its_weight_from_the_header() -> None:
    from tierserve.cluster.config import TenantConfig

    cfg = ClusterConfig(tiers=[TierConfig(name="standard", base_priority=5, max_priority=9,
                                          tenants=[TenantConfig(name="gw-team", weight=2.0)])])
    assert TierResolver(cfg).resolve(None, None, "gw-team").weight == 2.0
    with pytest.raises(ValueError, match="reserved"):
        TierConfig(name="standard", base_priority=5, max_priority=9,
                   tenants=[TenantConfig(name="standard-key0")])


@pytest.mark.parametrize("value", ["-x", "a b", "x" * 65, "é"])
def test_a_bad_tenant_header_is_a_clear_error(value: str) -> None:
    from tierserve.cluster.tiers import TenantError

    with pytest.raises(TenantError, match="tenant header"):
        tenant_resolver().resolve(None, None, value)
