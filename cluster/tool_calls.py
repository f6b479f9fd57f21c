"""OpenAI tool calling over a chat template: the prompt side and the answer side.

The format (the function-calling format the default model was trained on):

- the tools are listed in the system prompt inside ``<tools>...</tools>``, as a JSON list of the
  OpenAI tool objects (``tool_system_prompt``);
- the model answers calls as ``<tool_call>[{"name": "f", "arguments": {...}}, ...]</tool_call>``:
  a JSON list of calls (or one call object) between the tags, possibly several such blocks;
- a tool's result goes back to the model as a user turn ``<tool_response>\\n...\\n</tool_response>``.

A chat template that takes ``tools`` itself (``template_takes_tools``) gets the messages and tools
in the Hugging Face form instead (``render_messages``). ``call_schema`` is the JSON schema that
constrains the answer's call list when ``tool_choice`` demands a call, and ``ToolCallParser``
splits an answer (streamed or whole) into its content and its tool calls.

Only the standard library and the protocol models: this module sits below anything that loads a
model or a tokenizer.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Collection, Sequence
from typing import Any

from tierserve.cluster.protocol import (
    ChatMessage,
    FunctionCallOut,
    FunctionDelta,
    NamedToolChoice,
    Tool,
    ToolCallDelta,
    ToolCallOut,
)
from tierserve.records import BadRequest

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

# The arguments of a function declared without ``parameters``: an empty object.
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolMessageError(BadRequest, ValueError):
    """A request whose tools, tool choice or tool messages cannot be used; ``param`` names the
    field at fault (as an error body's ``param``), e.g. ``messages.3.tool_calls.0.function.arguments``."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message, param=param)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _refuse_constant(name: str) -> Any:
    # NaN and Infinity are not JSON: an answer holding them is no valid call.
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    """Strict JSON (no NaN or Infinity); raises ValueError when ``text`` is not JSON."""
    return json.loads(text, parse_constant=_refuse_constant)


# ----------------------------------------------------------------------------------------------
# The prompt side


def tool_system_prompt(tools: Sequence[Tool]) -> str:
    """The system text that lists ``tools`` (``<tools>`` + their JSON list + ``</tools>``) and
    tells the model how to answer a call: only ``<tool_call>[...]</tool_call>`` with no other
    text, or ordinary text when no call is needed."""
    listed = _dumps([t.model_dump(exclude_none=True) for t in tools])
    return (
        "You are a function calling AI model. You may call one or more of the functions listed "
        "below to help with the user's request.\n"
        f"<tools>{listed}</tools>\n"
        "To call functions, answer only with the calls in exactly this format and no other text:\n"
        f'{TOOL_CALL_OPEN}[{{"name": "function_name", "arguments": {{"argument": "value"}}}}]'
        f"{TOOL_CALL_CLOSE}\n"
        "The list holds one object per call: the function's \"name\" and its \"arguments\" as a "
        "JSON object that follows the function's parameters. The result of each call comes back "
        f"inside {TOOL_RESPONSE_OPEN}{TOOL_RESPONSE_CLOSE}. If no function call is needed, answer "
        "normally in text."
    )


def _uses_tools(tools: Sequence[Tool] | None, tool_choice: object) -> bool:
    return bool(tools) and tool_choice != "none"


def _call_arguments(message_index: int, call_index: int, arguments: str) -> dict[str, Any]:
    """An assistant message's call arguments (JSON text) as the object they hold (blank text:
    no arguments)."""
    param = f"messages.{message_index}.tool_calls.{call_index}.function.arguments"
    if not arguments.strip():
        return {}
    try:
        value = _loads(arguments)
    except ValueError as e:
        raise ToolMessageError(
            f"the arguments of tool call {call_index} in message {message_index} are not valid "
            f"JSON: {e}", param) from None
    if not isinstance(value, dict):
        raise ToolMessageError(
            f"the arguments of tool call {call_index} in message {message_index} must be a JSON "
            f"object, not {type(value).__name__}", param)
    return value


def _tool_call_text(message: ChatMessage, index: int) -> str:
    """An assistant message with calls, in the answer format: its text, then the calls' block."""
    calls = [{"name": c.function.name, "arguments": _call_arguments(index, j, c.function.arguments)}
             for j, c in enumerate(message.tool_calls or [])]
    block = f"{TOOL_CALL_OPEN}{_dumps(calls)}{TOOL_CALL_CLOSE}"
    text = message.text()
    return f"{text}\n{block}" if text else block


def _render_in_prompt(messages: Sequence[ChatMessage], tools: Sequence[Tool] | None,
                      tool_choice: object) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            out.append({"role": "assistant", "content": _tool_call_text(m, i)})
        elif m.role == "tool":
            out.append({"role": "user",
                        "content": f"{TOOL_RESPONSE_OPEN}\n{m.text()}\n{TOOL_RESPONSE_CLOSE}"})
        else:
            out.append({"role": m.template_role(), "content": m.text()})
    if tools and _uses_tools(tools, tool_choice):
        prompt = tool_system_prompt(tools)
        if out and out[0]["role"] == "system":
            first = out[0]["content"]
            out[0] = {"role": "system", "content": f"{first}\n\n{prompt}" if first else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _render_for_template(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name, for the tool messages that answer it
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            calls: list[dict[str, Any]] = []
            for j, c in enumerate(m.tool_calls):
                names[c.id] = c.function.name
                calls.append({"id": c.id, "type": "function", "function": {
                    "name": c.function.name,
                    "arguments": _call_arguments(i, j, c.function.arguments)}})
            out.append({"role": "assistant", "content": m.text(), "tool_calls": calls})
        elif m.role == "tool":
            entry: dict[str, Any] = {"role": "tool", "tool_call_id": m.tool_call_id,
                                     "content": m.text()}
            name = m.name or names.get(m.tool_call_id or "")
            if name is not None:
                entry["name"] = name
            out.append(entry)
        else:
            out.append({"role": m.template_role(), "content": m.text()})
    return out


def render_messages(
    messages: Sequence[ChatMessage],
    tools: Sequence[Tool] | None,
    tool_choice: object,
    template_takes_tools: bool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages for the tokenizer's ``apply_chat_template`` and its ``tools`` argument.

    ``template_takes_tools`` False (a plain template): the tools go into the system prompt
    (merged after the text of a leading system message with a blank line, or as a new first
    system message) unless ``tool_choice`` is ``"none"``; an assistant message's calls become
    its text followed by their ``<tool_call>`` block; a tool message becomes a user message
    ``<tool_response>\\n{content}\\n</tool_response>``; the returned tools are None.

    ``template_takes_tools`` True: the Hugging Face message form (assistant ``tool_calls`` with
    their arguments as objects, tool messages with their ``tool_call_id``) and the tools as
    dicts (None without tools or with ``tool_choice`` ``"none"``).

    Raises ``ToolMessageError`` when a call's arguments are not a JSON object.
    """
    if not template_takes_tools:
        return _render_in_prompt(messages, tools, tool_choice), None
    rendered = _render_for_template(messages)
    if tools and _uses_tools(tools, tool_choice):
        return rendered, [t.model_dump(exclude_none=True) for t in tools]
    return rendered, None


# ----------------------------------------------------------------------------------------------
# Constrained answers


def _named_function(tool_choice: object) -> str | None:
    """The function a named ``tool_choice`` names (the model or its dict form), else None."""
    if isinstance(tool_choice, NamedToolChoice):
        return tool_choice.function.name
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return str(function["name"])
    return None


_DEF_ROOTS = ("#/$defs/", "#/definitions/")


def _rebase(node: Any, renamed: dict[str, str], root: str) -> Any:
    """``node`` with every local ``$ref`` pointed at the call schema's top-level ``$defs``:
    ``#/$defs/X`` (or ``#/definitions/X``) becomes ``renamed[X]``, ``#`` the parameters'
    own entry ``root``."""
    if isinstance(node, list):
        return [_rebase(v, renamed, root) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str):
            if value == "#":
                value = f"#/$defs/{root}"
            for prefix in _DEF_ROOTS:
                if value.startswith(prefix):
                    head, _, rest = value[len(prefix):].partition("/")
                    if head in renamed:
                        value = f"#/$defs/{renamed[head]}" + (f"/{rest}" if rest else "")
            out[key] = value
        else:
            out[key] = _rebase(value, renamed, root)
    return out


def _call_item(tool: Tool, defs: dict[str, Any]) -> dict[str, Any]:
    """One call of ``tool``; the definitions its parameters refer to (``$defs``,
    ``definitions``) move into ``defs``, named after the tool, since the parameters no longer
    sit at the root their references start from."""
    parameters = tool.function.parameters
    arguments = copy.deepcopy(parameters if parameters is not None else NO_ARGUMENTS)
    name = tool.function.name
    own: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        found = arguments.pop(key, None)
        if isinstance(found, dict):
            own.update(found)
    renamed = {k: f"{name}.{k}" for k in own}
    root = f"{name}."
    arguments = _rebase(arguments, renamed, root)
    for k, v in own.items():
        defs[renamed[k]] = _rebase(v, renamed, root)
    if _refers_to_root(arguments) or any(_refers_to_root(v) for v in defs.values()):
        defs[root] = arguments
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _refers_to_root(node: Any) -> bool:
    if isinstance(node, list):
        return any(_refers_to_root(v) for v in node)
    if isinstance(node, dict):
        return any((k == "$ref" and v.endswith(".") and v.startswith("#/$defs/"))
                   or _refers_to_root(v) for k, v in node.items())
    return False


def call_schema(tools: Sequence[Tool], tool_choice: object, parallel: bool) -> dict[str, Any]:
    """The JSON schema of the call list an answer must hold (between ``<tool_call>`` and
    ``</tool_call>``) when ``tool_choice`` is ``"required"`` or names a function: a non-empty
    array of ``{"name": ..., "arguments": ...}`` objects, of any declared tool (``"required"``)
    or of the named one only; at most one call when ``parallel`` is False or a function is named.

    Raises ``ToolMessageError`` (param ``tool_choice``) when the named function is not declared,
    or when there are no tools to call; ``ValueError`` for a ``tool_choice`` that demands no call.
    """
    declared = [t.function.name for t in tools]
    named = _named_function(tool_choice)
    if named is not None:
        chosen = [t for t in tools if t.function.name == named]
        if not chosen:
            listed = ", ".join(repr(n) for n in declared) or "none"
            raise ToolMessageError(
                f"tool_choice names the function {named!r}, which is not among the tools "
                f"(declared: {listed})", "tool_choice")
        defs: dict[str, Any] = {}
        one: dict[str, Any] = {"type": "array", "minItems": 1, "maxItems": 1,
                               "items": _call_item(chosen[0], defs)}
        return one | ({"$defs": defs} if defs else {})
    if tool_choice != "required":
        raise ValueError(f"tool_choice {tool_choice!r} does not demand a call: no call schema")
    if not tools:
        raise ToolMessageError("tool_choice 'required' needs tools to call", "tool_choice")
    all_defs: dict[str, Any] = {}
    items = [_call_item(t, all_defs) for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if all_defs:
        schema["$defs"] = all_defs
    return schema


# ----------------------------------------------------------------------------------------------
# The answer side


def new_call_id() -> str:
    """A tool call's id: ``call_`` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def _partial_tag(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` may be the beginning of ``tag`` (0: none)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallParser:
    """Splits one answer, fed in pieces as it is generated, into content and tool calls.

    Text outside ``<tool_call>...</tool_call>`` is content, given out as soon as it cannot be the
    beginning of ``<tool_call>``. A block's text is held until its ``</tool_call>``; then its JSON
    (a list of calls or one call) is read: every element must be an object with a ``"name"``
    among ``tool_names`` and ``"arguments"`` an object (or a JSON string of one). A block that
    reads so gives its calls (each one as two deltas: id, type and name, then the arguments);
    any other block is given out as content, tags and all, so nothing is lost.

    Splitting the same answer differently gives the same content and calls (but for the ids).
    """

    def __init__(self, tool_names: Collection[str]) -> None:
        self.tool_names: frozenset[str] = frozenset(tool_names)
        self.calls: list[ToolCallOut] = []
        self._content: list[str] = []
        self._buffer = ""
        self._inside = False  # in a block: _buffer holds its text after the open tag
        self._scanned = 0  # in a block: _buffer[:_scanned] holds no close tag

    @property
    def content(self) -> str:
        """All the content given out so far."""
        return "".join(self._content)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Takes the answer's next piece; returns the content that can go out now and the deltas
        of the calls completed now."""
        self._buffer += text
        out: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if not self._inside:
                start = self._buffer.find(TOOL_CALL_OPEN)
                if start < 0:
                    keep = _partial_tag(self._buffer, TOOL_CALL_OPEN)
                    out.append(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                out.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(TOOL_CALL_OPEN):]
                self._inside, self._scanned = True, 0
            else:
                end = self._buffer.find(TOOL_CALL_CLOSE, self._scanned)
                if end < 0:
                    self._scanned = max(0, len(self._buffer) - len(TOOL_CALL_CLOSE) + 1)
                    break
                block = self._buffer[:end]
                self._buffer = self._buffer[end + len(TOOL_CALL_CLOSE):]
                self._inside = False
                out.append(self._block(block, TOOL_CALL_OPEN + block + TOOL_CALL_CLOSE, deltas))
        return self._emit(out), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Ends the answer: held-back text is content; a block left open is read as if closed
        (its calls count if it reads as calls, else its text is content)."""
        deltas: list[ToolCallDelta] = []
        if self._inside:
            raw = TOOL_CALL_OPEN + self._buffer
            cut = _partial_tag(self._buffer, TOOL_CALL_CLOSE)  # an answer cut inside the tag
            text = self._block(self._buffer[:len(self._buffer) - cut], raw, deltas)
        else:
            text = self._buffer
        self._buffer, self._inside, self._scanned = "", False, 0
        return self._emit([text]), deltas

    def _emit(self, pieces: list[str]) -> str:
        text = "".join(pieces)
        if text:
            self._content.append(text)
        return text

    def _block(self, block: str, raw: str, deltas: list[ToolCallDelta]) -> str:
        """Reads one block: adds its calls and their deltas and returns "", or returns ``raw``
        (the block's original text) when it is not a list of valid calls."""
        calls = self._read_calls(block)
        if calls is None:
            return raw
        for name, arguments in calls:
            index = len(self.calls)
            call = ToolCallOut(id=new_call_id(),
                               function=FunctionCallOut(name=name, arguments=arguments))
            self.calls.append(call)
            deltas.append(ToolCallDelta(index=index, id=call.id, type="function",
                                        function=FunctionDelta(name=name, arguments="")))
            deltas.append(ToolCallDelta(index=index, function=FunctionDelta(arguments=arguments)))
        return ""

    def _read_calls(self, block: str) -> list[tuple[str, str]] | None:
        """The block's calls as (name, arguments JSON), or None if any of it is not a call."""
        try:
            value = _loads(block)
        except ValueError:
            return None
        elements = value if isinstance(value, list) else [value]
        if not elements:
            return None
        calls: list[tuple[str, str]] = []
        for element in elements:
            if not isinstance(element, dict):
                return None
            name = element.get("name")
            if not isinstance(name, str) or name not in self.tool_names:
                return None
            arguments = element.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = _loads(arguments)
                except ValueError:
                    return None
            if not isinstance(arguments, dict):
                return None
            calls.append((name, _dumps(arguments)))
        return calls


def parse_tool_calls(text: str, tool_names: Collection[str]) -> tuple[str | None, list[ToolCallOut]]:
    """A whole answer's content and tool calls. With calls, the content is stripped of the
    whitespace around them (None when nothing else is left); without, it is ``text`` unchanged."""
    parser = ToolCallParser(tool_names)
    parser.feed(text)
    parser.finish()
    if not parser.calls:
        return parser.content, []
    return parser.content.strip() or None, parser.calls
