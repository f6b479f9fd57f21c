"""Chat messages to prompt ids through the model's chat template: the one rendering that the
HTTP chat route, ``/tokenize`` of messages and the offline ``LLM.chat``
(``tierserve.cluster.offline``) share, so that the same conversation gives the same ids on
every path.

The messages and tools come in as ``tierserve.cluster.tool_calls.render_messages`` makes them
(Hugging Face's message dicts); what is rendered besides them (the generation prompt or the
open last message, documents, ``chat_template_kwargs``) is ``template_kwargs``'s. Synchronous
and pure: the ingress runs ``render_chat`` on its tokenizing pool.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from tierserve.records import BadRequest


class TemplateArgumentError(BadRequest, ValueError):
    """A ``chat_template_kwargs`` name that is an argument of the renderer, not a template
    variable (a 400 at the API, a ``ValueError`` offline)."""

    code = "invalid_request"


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer has a chat template (a base model's has none)."""
    return bool(getattr(tokenizer, "chat_template", None))


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the chat template lists tools itself; else they go in the system prompt
    (``tierserve.cluster.tool_calls``)."""
    return "tools" in str(getattr(tokenizer, "chat_template", "") or "")


def template_arguments(tokenizer: Any) -> frozenset[str]:
    """The parameter names of the tokenizer's ``apply_chat_template``."""
    try:
        params = inspect.signature(tokenizer.apply_chat_template).parameters
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(name for name, p in params.items()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def template_kwargs(tokenizer: Any, *, add_generation_prompt: bool,
                    continue_final_message: bool = False,
                    documents: Sequence[Mapping[str, str]] | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What the chat template is rendered with besides the messages and tools: the
    generation prompt or the open last message, documents, and ``chat_template_kwargs``
    (variables the template reads). A name ``apply_chat_template`` takes itself is a
    ``TemplateArgumentError``, so that a variable cannot turn into one of its arguments."""
    out: dict[str, Any] = {"add_generation_prompt": add_generation_prompt}
    if continue_final_message:
        out["continue_final_message"] = True
    if documents is not None:
        out["documents"] = documents
    taken = template_arguments(tokenizer) if chat_template_kwargs else frozenset()
    for key, value in (chat_template_kwargs or {}).items():
        if key in taken or key in ("messages", "tools", "documents"):
            raise TemplateArgumentError(
                f"chat_template_kwargs.{key}: {key!r} is an argument of the template's "
                "renderer, not a template variable; use the request's own field where there "
                "is one", param=f"chat_template_kwargs.{key}")
        out[key] = value
    return out


def render_chat(tokenizer: Any, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None, extra: Mapping[str, Any],
                add_special_tokens: bool) -> list[int]:
    """The ids the chat template renders ``messages`` and ``tools`` to, with ``extra``
    (``template_kwargs``'s). ``add_special_tokens``: the template's text is encoded with the
    tokenizer's own special tokens on top (a BOS the template may already have put there);
    else the template's tokens alone. Whatever the template raises is the caller's to report
    (the messages did not render)."""
    if add_special_tokens:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **extra)
        return list(tokenizer.encode(text, add_special_tokens=True))
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                        return_dict=False, **extra)
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return list(ids)
