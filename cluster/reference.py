"""The configuration reference, made from the config models themselves: every field's
default and its ``description`` as the Markdown tables of docs/config.md, docs/tiers.md and
docs/autoscaling.md. A field's meaning is written once, on the field; the docs hold the tables
this module makes (a test compares them), and ``python -m tierserve.cluster.reference --write``
rewrites them after a field changes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from tierserve.cluster.autoscaling import AutoscalePolicyConfig
from tierserve.cluster.config import ClusterConfig, ModelConfig, TenantConfig, TierConfig
from tierserve.router.routing import RouterSettings

# Nested models whose fields are listed one by one under the field's name.
_EXPANDED = frozenset({"engine", "flow", "structured_limits"})


@dataclass(frozen=True, slots=True)
class Table:
    """One reference table: the doc that holds it (relative to the repository), its header
    line and its rows (field, default, meaning)."""

    doc: str
    header: str
    rows: list[tuple[str, str, str]]

    def markdown(self) -> str:
        lines = [self.header, "|---|---|---|"]
        lines += [f"| `{f}` | {d} | {m} |" for f, d, m in self.rows]
        return "\n".join(lines) + "\n"


def cell(value: Any) -> str:
    """A default as the tables write it."""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, (list, tuple)):
        return "`[]`" if not value else "`" + ", ".join(str(v) for v in value) + "`"
    if isinstance(value, SecretStr):
        return "(secret)"
    return str(value)


def _default(info: FieldInfo) -> str:
    extra = info.json_schema_extra
    if isinstance(extra, dict) and "doc_default" in extra:
        return str(extra["doc_default"])
    if info.default is not PydanticUndefined:
        return cell(info.default)
    if info.default_factory is not None:
        return cell(info.default_factory())  # type: ignore[call-arg]
    return "(required)"


def _meaning(info: FieldInfo, where: str) -> str:
    if not info.description:
        raise ValueError(f"{where} has no description: every config field says what it does")
    # Descriptions link docs from the repository's root; the tables live in docs/.
    return info.description.replace("](docs/", "](")


def rows(model: type[BaseModel], prefix: str = "", expand: frozenset[str] = _EXPANDED
         ) -> Iterator[tuple[str, str, str]]:
    """Every field of ``model`` (nested models of ``expand`` field by field), in order."""
    for name, info in model.model_fields.items():
        path = prefix + name
        nested = info.annotation
        if name in expand and isinstance(nested, type) and issubclass(nested, BaseModel):
            yield from rows(nested, path + ".")
            continue
        yield path, _default(info), _meaning(info, f"{model.__name__}.{name}")


def tables() -> list[Table]:
    """Every reference table, as the docs hold them."""
    tier = list(rows(TierConfig))
    tier += [(f"tenants[].{f}", d, m) for f, d, m in rows(TenantConfig)]
    return [
        Table("docs/config.md", "| `args` field | default | meaning |", list(rows(ClusterConfig))),
        # A model's engine is the same fields as the top-level ``engine``: one row for them.
        Table("docs/config.md", "| `models[]` field | default | meaning |",
              list(rows(ModelConfig, "models[].", frozenset()))),
        Table("docs/config.md", "| `request_router_kwargs` field | default | meaning |",
              list(rows(RouterSettings))),
        Table("docs/tiers.md", "| tier field | default | meaning |", tier),
        Table("docs/autoscaling.md", "| `policy_kwargs` field | default | meaning |",
              list(rows(AutoscalePolicyConfig))),
    ]


def held(text: str, header: str) -> str:
    """The table under ``header`` in ``text`` as it stands (up to its first non-table line)."""
    start = text.index(header)
    lines = []
    for line in text[start:].splitlines():
        if not line.startswith("|"):
            break
        lines.append(line)
    return "\n".join(lines) + "\n"


def write(root: Path) -> list[str]:
    """Rewrite every table in its doc under ``root``; the docs changed."""
    changed = []
    for t in tables():
        path = root / t.doc
        text = path.read_text()
        old = held(text, t.header)
        if old != t.markdown():
            path.write_text(text.replace(old, t.markdown(), 1))
            changed.append(t.doc)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true",
                        help="rewrite the tables in the docs (run from the repository's root)")
    args = parser.parse_args(argv)
    if args.write:
        for doc in write(Path.cwd()):
            print(f"rewrote a table in {doc}")
        return 0
    for t in tables():
        sys.stdout.write(f"\n{t.doc}:\n\n{t.markdown()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
