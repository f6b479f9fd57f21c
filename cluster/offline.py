"""The offline ``LLM`` that ``from tierserve import LLM`` gives: the replica's
(``tierserve.replica.llm.LLM``: ``generate``, ``get_tokenizer``, ``stats``) with ``chat``.

``chat`` sits in this layer because a conversation becomes a prompt here exactly as the HTTP
chat route makes it: the messages checked by the API's own message models
(``tierserve.cluster.protocol``), rendered by ``tierserve.cluster.tool_calls.render_messages``
and the shared ``tierserve.cluster.chat_template.render_chat``, with the route's defaults (the
generation prompt, no special tokens beyond the template's) and its tool-call format (the
``tool_call_parser`` option, as the config's field, else the chat template's markers:
``tierserve.cluster.tool_calls.resolve_tool_format``). The answer is not parsed for
tool calls (the text comes back as the model wrote it, as vLLM's offline ``chat`` does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import TypeAdapter, ValidationError

from tierserve.cluster.chat_template import (
    has_chat_template,
    render_chat,
    template_kwargs,
    template_takes_tools,
)
from tierserve.cluster.protocol import Message, Tool
from tierserve.cluster.tool_calls import (
    check_tool_format,
    render_messages,
    resolve_tool_format,
)
from tierserve.records import LoRARequest, SamplingParams
from tierserve.replica.llm import LLM as ReplicaLLM
from tierserve.replica.llm import RequestOutput
from tierserve.replica.models.catalog import DEFAULT_MODEL

Conversation = Sequence[Mapping[str, Any]]

_MESSAGES: TypeAdapter[list[Any]] = TypeAdapter(list[Message])
_TOOLS: TypeAdapter[list[Tool]] = TypeAdapter(list[Tool])


def _first_error(e: ValidationError, what: str) -> str:
    """Pydantic's first complaint as one line: where (``what`` and its path) and what."""
    err = e.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ()))
    return f"{what}.{where}: {err.get('msg', 'invalid')}" if where else f"{what}: {err['msg']}"


class LLM(ReplicaLLM):
    """One engine in this process (options: ``EngineConfig``'s), vLLM's offline API:
    ``generate`` (``tierserve.replica.llm.LLM``) and ``chat``. ``tool_call_parser``: the
    format of the model's tool calls (``hermes``, ``llama3_json``, ``mistral``), as the serving
    config's field; None (the default): the chat template's (``ValueError`` for an unknown
    name, before the engine is built)."""

    def __init__(self, model: str = DEFAULT_MODEL, *, tool_call_parser: str | None = None,
                 **options: Any) -> None:
        self.tool_call_parser = (None if tool_call_parser is None
                                 else check_tool_format(tool_call_parser))
        super().__init__(model, **options)

    @property
    def tool_format(self) -> str:
        """The format ``chat`` writes tools and earlier calls in: ``tool_call_parser``, else
        the chat template's, as the HTTP route resolves it."""
        return resolve_tool_format(self.tool_call_parser,
                                   str(getattr(self.tokenizer, "chat_template", "") or ""))

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` dicts, as the HTTP chat
        route takes them) or a list of them; one ``RequestOutput`` per conversation, its
        ``prompt`` the rendered template's text. ``chat_template_kwargs``: variables for the
        template; ``add_generation_prompt`` / ``continue_final_message``: how the prompt ends
        (the last message left open instead of a new answer); ``tools``: function tools in the
        API's shape, rendered as the chat route renders them (into the template, or the system
        prompt when the template takes none), in the model's call format (``tool_format``; for
        ``mistral`` the history's call ids mapped to 9 characters). ``lora_request``: as
        ``generate``'s, per conversation.

        Raises ``ValueError`` naming the conversation and message at fault (no role, an
        unknown role, bad content, a tool that is not a function tool, a template that cannot
        render them, no chat template) before any work is done; the engine stays usable.
        """
        conversations = self._conversations(messages)
        if not has_chat_template(self.tokenizer):
            raise ValueError("this model has no chat template (a base model, which continues "
                             "text): use generate with a prompt instead")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "true: pass add_generation_prompt=False to continue the last "
                             "message")
        api_tools = self._tools(tools)
        extra = template_kwargs(self.tokenizer, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message,
                                chat_template_kwargs=chat_template_kwargs)
        takes_tools = template_takes_tools(self.tokenizer)
        tool_format = self.tool_format
        ids_list: list[list[int]] = []
        for c, conversation in enumerate(conversations):
            checked = self._messages(c, conversation)
            rendered, template_tools = render_messages(checked, api_tools, "auto", takes_tools,
                                                       tool_format)
            try:
                ids_list.append(render_chat(self.tokenizer, rendered, template_tools, extra,
                                            add_special_tokens=False))
            except Exception as e:
                raise ValueError(f"conversation {c}: the chat template could not render these "
                                 f"messages: {e}") from e
        texts: list[str | None] = [
            str(self.tokenizer.decode(ids, skip_special_tokens=False)) for ids in ids_list]
        params = self._per_prompt(sampling_params, len(ids_list))
        loras = self._per_prompt_lora(lora_request, len(ids_list))
        return self._run(ids_list, texts, params, None, use_tqdm, loras)

    @staticmethod
    def _conversations(messages: Conversation | Sequence[Conversation]
                       ) -> list[Conversation]:
        if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
            raise ValueError("messages must be a list of {'role', 'content'} dicts (one "
                             "conversation) or a list of such lists, got "
                             f"{type(messages).__name__}")
        if not messages:
            raise ValueError("no messages: give at least one conversation")
        if isinstance(messages[0], Mapping):
            return [messages]  # type: ignore[list-item]
        return list(messages)  # type: ignore[arg-type]

    @staticmethod
    def _messages(c: int, conversation: Any) -> list[Any]:
        """``conversation`` checked as the chat route checks its ``messages``."""
        if not isinstance(conversation, Sequence) or isinstance(conversation, str | bytes):
            raise ValueError(f"conversation {c} must be a list of message dicts, got "
                             f"{type(conversation).__name__}")
        if not conversation:
            raise ValueError(f"conversation {c} has no messages")
        for m, message in enumerate(conversation):
            if not isinstance(message, Mapping):
                raise ValueError(f"conversation {c}, message {m} must be a dict with 'role' and "
                                 f"'content', got {type(message).__name__}")
            if "role" not in message:
                raise ValueError(f"conversation {c}, message {m} has no 'role' (one of system, "
                                 "developer, user, assistant, tool)")
        try:
            return _MESSAGES.validate_python([dict(m) for m in conversation])
        except ValidationError as e:
            raise ValueError(f"conversation {c}: {_first_error(e, 'message')}") from None

    @staticmethod
    def _tools(tools: Sequence[Mapping[str, Any]] | None) -> list[Tool] | None:
        if tools is None:
            return None
        if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence):
            raise ValueError(f"tools must be a list of function tools, got {type(tools).__name__}")
        try:
            return _TOOLS.validate_python([dict(t) if isinstance(t, Mapping) else t
                                           for t in tools]) or None
        except ValidationError as e:
            raise ValueError(_first_error(e, "tools")) from None
