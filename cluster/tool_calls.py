"""OpenAI tool calling over a chat template: the prompt side and the answer side.

Three call formats (``TOOL_FORMATS``, named as vLLM's ``--tool-call-parser`` names them):

- ``hermes`` (the default model's, Hermes and Qwen templates'): calls as
  ``<tool_call>[{"name": "f", "arguments": {...}}, ...]</tool_call>``, a JSON list of calls (or
  one call object) between the tags, possibly several such blocks, anywhere in the answer;
- ``llama3_json`` (Llama 3.1 to 3.3 templates'): the answer is the calls themselves, JSON objects
  ``{"name": "f", "parameters": {...}}`` (``"arguments"`` read too), optionally after
  ``<|python_tag|>``, separated by ``;`` or blanks (or a JSON list of them); an answer that does
  not begin with a call is content;
- ``mistral`` (Mistral templates'): ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` or
  the newer ``[TOOL_CALLS]f[ARGS]{...}`` (one marker per call). The markers are special tokens of
  Mistral's tokenizers, left out of the text when ``skip_special_tokens`` (the default): an
  answer that *begins* with a call list, or with a declared function's name and its arguments
  object, is read as calls too. Call ids are 9 letters and digits, as Mistral's templates
  demand.

The format is the config's ``tool_call_parser`` or, without one, the chat template's
(``detect_tool_format``: the markers it contains).

The prompt side: a chat template that takes ``tools`` itself (``template_takes_tools``) gets the
messages and tools in the Hugging Face form (``render_messages``; for ``mistral`` the history's
call ids mapped to 9 characters). A plain template gets them in the system prompt
(``tool_system_prompt``: the tools inside ``<tools>...</tools>`` and the format's call syntax),
earlier calls written back in the format's syntax and a tool's result as a user turn
``<tool_response>\\n...\\n</tool_response>``.

The answer side: ``call_output`` is the constraint (a JSON schema of the call list, and the text
around it) of an answer that must call a tool (``tool_choice`` ``required`` or named);
``make_parser`` splits an answer (streamed or whole) into its content and its tool calls.

Only the standard library and the protocol models: this module sits below anything that loads a
model or a tokenizer.
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import json
import re
import secrets
import string
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
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
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x: what may open an answer of calls
MISTRAL_CALLS = "[TOOL_CALLS]"  # Mistral: what opens its calls (or each call, with [ARGS])
MISTRAL_ARGS = "[ARGS]"  # Mistral's newer form: between a call's name and its arguments

# The call formats, by vLLM's ``--tool-call-parser`` names.
HERMES, LLAMA3_JSON, MISTRAL = "hermes", "llama3_json", "mistral"
TOOL_FORMATS: tuple[str, ...] = (HERMES, LLAMA3_JSON, MISTRAL)

# Mistral's call ids: 9 letters and digits (its templates refuse others).
MISTRAL_ID_LENGTH = 9
_ALNUM = string.ascii_letters + string.digits
_MISTRAL_ID = re.compile(r"^[A-Za-z0-9]{9}$")
# Llama 3.x's instruction for calls as JSON (its templates write it when given tools).
_LLAMA_JSON_HINT = re.compile(r'"parameters"\s*:\s*dictionary of argument name')

# The arguments of a function declared without ``parameters``: an empty object.
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolMessageError(BadRequest, ValueError):
    """A request whose tools, tool choice or tool messages cannot be used; ``param`` names the
    field at fault (as an error body's ``param``), e.g. ``messages.3.tool_calls.0.function.arguments``."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message, param=param)


def check_tool_format(name: str) -> str:
    """``name`` when it is one of ``TOOL_FORMATS``; else ``ValueError`` listing them."""
    if name not in TOOL_FORMATS:
        raise ValueError(f"unknown tool_call_parser {name!r}: the known ones are "
                         f"{', '.join(TOOL_FORMATS)}")
    return name


def detect_tool_format(template: str | None) -> str:
    """The call format a chat template asks for, by the markers it contains: ``[TOOL_CALLS]``
    is Mistral's, ``<tool_call>`` Hermes' (and Qwen's), ``<|python_tag|>`` or Llama 3.x's
    instruction to answer ``{"name": ..., "parameters": dictionary of argument name ...}`` is
    ``llama3_json``; any other template (or none) gets ``hermes``, the format of the system
    prompt that lists the tools where the template does not."""
    text = template or ""
    if MISTRAL_CALLS in text:
        return MISTRAL
    if TOOL_CALL_OPEN in text:
        return HERMES
    if PYTHON_TAG in text or _LLAMA_JSON_HINT.search(text):
        return LLAMA3_JSON
    return HERMES


def resolve_tool_format(configured: str | None, template: str | None) -> str:
    """The format a server uses: the configured one (``ValueError`` for an unknown name), else
    the template's (``detect_tool_format``)."""
    if configured is not None:
        return check_tool_format(configured)
    return detect_tool_format(template)


def mistral_call_id(call_id: str) -> str:
    """``call_id`` as Mistral's templates take it: itself when it is 9 letters and digits,
    else 9 of them made from its SHA-256 (the same id always maps to the same, so an assistant
    call and the tool message that answers it still match)."""
    if _MISTRAL_ID.match(call_id):
        return call_id
    n = int.from_bytes(hashlib.sha256(call_id.encode("utf-8")).digest(), "big")
    out = []
    for _ in range(MISTRAL_ID_LENGTH):
        n, k = divmod(n, len(_ALNUM))
        out.append(_ALNUM[k])
    return "".join(out)


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


def tool_system_prompt(tools: Sequence[Tool], tool_format: str = HERMES) -> str:
    """The system text that lists ``tools`` (``<tools>`` + their JSON list + ``</tools>``) and
    tells the model how to answer a call in ``tool_format``: only the calls with no other text
    (``<tool_call>[...]</tool_call>``, ``{"name": ..., "parameters": ...}`` objects one a line,
    or ``[TOOL_CALLS][...]``), or ordinary text when no call is needed."""
    listed = _dumps([t.model_dump(exclude_none=True) for t in tools])
    if tool_format == LLAMA3_JSON:
        syntax = ('{"name": "function_name", "parameters": {"argument": "value"}}\n'
                  "One object per call, one call a line: the function's \"name\" and its "
                  "\"parameters\" as a JSON object that follows the function's parameters.")
    else:
        example = '[{"name": "function_name", "arguments": {"argument": "value"}}]'
        syntax = (f"{MISTRAL_CALLS}{example}" if tool_format == MISTRAL
                  else f"{TOOL_CALL_OPEN}{example}{TOOL_CALL_CLOSE}")
        syntax += ("\nThe list holds one object per call: the function's \"name\" and its "
                   "\"arguments\" as a JSON object that follows the function's parameters.")
    return (
        "You are a function calling AI model. You may call one or more of the functions listed "
        "below to help with the user's request.\n"
        f"<tools>{listed}</tools>\n"
        "To call functions, answer only with the calls in exactly this format and no other text:\n"
        f"{syntax} The result of each call comes back inside "
        f"{TOOL_RESPONSE_OPEN}{TOOL_RESPONSE_CLOSE}. If no function call is needed, answer "
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


def _tool_call_text(message: ChatMessage, index: int, tool_format: str = HERMES) -> str:
    """An assistant message with calls, in the answer format: its text, then the calls (a
    ``<tool_call>`` block, Llama's JSON objects one a line, or ``[TOOL_CALLS]`` and the list)."""
    key = "parameters" if tool_format == LLAMA3_JSON else "arguments"
    calls = [{"name": c.function.name, key: _call_arguments(index, j, c.function.arguments)}
             for j, c in enumerate(message.tool_calls or [])]
    if tool_format == LLAMA3_JSON:
        block = "\n".join(_dumps(c) for c in calls)
    elif tool_format == MISTRAL:
        block = f"{MISTRAL_CALLS}{_dumps(calls)}"
    else:
        block = f"{TOOL_CALL_OPEN}{_dumps(calls)}{TOOL_CALL_CLOSE}"
    text = message.text()
    return f"{text}\n{block}" if text else block


def _render_in_prompt(messages: Sequence[ChatMessage], tools: Sequence[Tool] | None,
                      tool_choice: object, tool_format: str = HERMES) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            out.append({"role": "assistant", "content": _tool_call_text(m, i, tool_format)})
        elif m.role == "tool":
            out.append({"role": "user",
                        "content": f"{TOOL_RESPONSE_OPEN}\n{m.text()}\n{TOOL_RESPONSE_CLOSE}"})
        else:
            out.append({"role": m.template_role(), "content": m.text()})
    if tools and _uses_tools(tools, tool_choice):
        prompt = tool_system_prompt(tools, tool_format)
        if out and out[0]["role"] == "system":
            first = out[0]["content"]
            out[0] = {"role": "system", "content": f"{first}\n\n{prompt}" if first else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _render_for_template(messages: Sequence[ChatMessage],
                         tool_format: str = HERMES) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name, for the tool messages that answer it
    # The ids as the template takes them: Mistral's, 9 letters and digits.
    ids: Callable[[str], str] = mistral_call_id if tool_format == MISTRAL else str
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            calls: list[dict[str, Any]] = []
            for j, c in enumerate(m.tool_calls):
                names[c.id] = c.function.name
                calls.append({"id": ids(c.id), "type": "function", "function": {
                    "name": c.function.name,
                    "arguments": _call_arguments(i, j, c.function.arguments)}})
            out.append({"role": "assistant", "content": m.text(), "tool_calls": calls})
        elif m.role == "tool":
            call_id = m.tool_call_id
            entry: dict[str, Any] = {"role": "tool",
                                     "tool_call_id": None if call_id is None else ids(call_id),
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
    tool_format: str = HERMES,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages for the tokenizer's ``apply_chat_template`` and its ``tools`` argument.

    ``template_takes_tools`` False (a plain template): the tools go into the system prompt
    (``tool_system_prompt`` in ``tool_format``, merged after the text of a leading system
    message with a blank line, or as a new first system message) unless ``tool_choice`` is
    ``"none"``; an assistant message's calls become its text followed by the calls in
    ``tool_format``'s syntax; a tool message becomes a user message
    ``<tool_response>\\n{content}\\n</tool_response>``; the returned tools are None.

    ``template_takes_tools`` True: the Hugging Face message form (assistant ``tool_calls`` with
    their arguments as objects, tool messages with their ``tool_call_id``; for ``mistral``
    every such id mapped by ``mistral_call_id``) and the tools as dicts (None without tools or
    with ``tool_choice`` ``"none"``).

    Raises ``ToolMessageError`` when a call's arguments are not a JSON object.
    """
    if not template_takes_tools:
        return _render_in_prompt(messages, tools, tool_choice, tool_format), None
    rendered = _render_for_template(messages, tool_format)
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


def _call_item(tool: Tool, defs: dict[str, Any], arguments_key: str = "arguments"
               ) -> dict[str, Any]:
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
        "properties": {"name": {"const": name}, arguments_key: arguments},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _refers_to_root(node: Any) -> bool:
    if isinstance(node, list):
        return any(_refers_to_root(v) for v in node)
    if isinstance(node, dict):
        return any((k == "$ref" and v.endswith(".") and v.startswith("#/$defs/"))
                   or _refers_to_root(v) for k, v in node.items())
    return False


def call_schema(tools: Sequence[Tool], tool_choice: object, parallel: bool,
                key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of the call list an answer must hold (``call_output``) when
    ``tool_choice`` is ``"required"`` or names a function: a non-empty array of
    ``{"name": ..., key: ...}`` objects (``key`` the arguments' name), of any declared tool
    (``"required"``) or of the named one only; at most one call when ``parallel`` is False or a
    function is named.

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
                               "items": _call_item(chosen[0], defs, key)}
        return one | ({"$defs": defs} if defs else {})
    if tool_choice != "required":
        raise ValueError(f"tool_choice {tool_choice!r} does not demand a call: no call schema")
    if not tools:
        raise ToolMessageError("tool_choice 'required' needs tools to call", "tool_choice")
    all_defs: dict[str, Any] = {}
    items = [_call_item(t, all_defs, key) for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if all_defs:
        schema["$defs"] = all_defs
    return schema


@dataclass(frozen=True, slots=True)
class CallOutput:
    """What an answer that must call a tool is constrained to: ``prefix``, then a JSON value
    of ``schema`` (the call list), then ``suffix``."""

    schema: dict[str, Any]
    prefix: str
    suffix: str


def call_output(tools: Sequence[Tool], tool_choice: object, parallel: bool,
                tool_format: str = HERMES) -> CallOutput:
    """The constraint of ``tool_choice`` ``"required"`` or named (``call_schema``'s errors),
    in the surface form ``tool_format``'s parser reads:

    - ``hermes``: ``<tool_call>[{"name": ..., "arguments": ...}, ...]</tool_call>``;
    - ``llama3_json``: the bare list ``[{"name": ..., "parameters": ...}, ...]`` (Llama's own
      key; ``<|python_tag|>`` is a special token a grammar over text does not write, and it is
      optional in the format);
    - ``mistral``: the bare list ``[{"name": ..., "arguments": ...}, ...]``, the marker-less
      ``[TOOL_CALLS]`` form (``[TOOL_CALLS]`` is a special token of Mistral's tokenizers, and
      an answer is read the same with or without it).

    Each parser reads an answer that begins with such a list as calls."""
    if tool_format == LLAMA3_JSON:
        return CallOutput(call_schema(tools, tool_choice, parallel, "parameters"), "", "")
    schema = call_schema(tools, tool_choice, parallel)
    if tool_format == MISTRAL:
        return CallOutput(schema, "", "")
    return CallOutput(schema, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)


# ----------------------------------------------------------------------------------------------
# The answer side


def new_call_id() -> str:
    """A tool call's id: ``call_`` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


def new_mistral_call_id() -> str:
    """A tool call's id as Mistral's templates take it back: 9 letters and digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(MISTRAL_ID_LENGTH))


def _partial_tag(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` may be the beginning of ``tag`` (0: none)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _read_arguments(name: str, arguments: Any) -> tuple[str, str] | None:
    """(name, arguments as compact JSON) when ``arguments`` is an object (or a JSON string of
    one), else None."""
    if isinstance(arguments, str):
        try:
            arguments = _loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return name, _dumps(arguments)


def _read_call(element: Any, names: frozenset[str], keys: tuple[str, ...]) -> tuple[str, str] | None:
    """One call object: ``"name"`` among ``names`` and its arguments under the first of
    ``keys`` it has; None if it is not one."""
    if not isinstance(element, dict):
        return None
    name = element.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    key = next((k for k in keys if k in element), None)
    return None if key is None else _read_arguments(name, element[key])


def _read_calls(text: str, names: frozenset[str],
                keys: tuple[str, ...] = ("arguments",)) -> list[tuple[str, str]] | None:
    """The calls of a JSON list of calls (or of one call) as (name, arguments JSON), or None
    if ``text`` is not JSON or any of it is not a call."""
    try:
        value = _loads(text)
    except ValueError:
        return None
    elements = value if isinstance(value, list) else [value]
    if not elements:
        return None
    calls = []
    for element in elements:
        call = _read_call(element, names, keys)
        if call is None:
            return None
        calls.append(call)
    return calls


class _JsonEnd:
    """Finds where a JSON value that opens with ``{`` or ``[`` closes, fed the text as it grows:
    brackets are counted outside strings. Linear in the text, however it is split; the value
    found may still not be JSON (``json.loads`` decides)."""

    __slots__ = ("_depth", "_end", "_escape", "_pos", "_string")

    @property
    def pos(self) -> int:
        """Where the next ``find`` resumes: the text before it is read."""
        return self._pos

    def __init__(self, start: int) -> None:
        self._pos = start
        self._end: int | None = None
        self._depth = 0
        self._string = False
        self._escape = False

    def find(self, text: str, start: int = 0) -> int | None:
        """The index just past the value's closing bracket, or None while it is open.
        ``text`` is the answer from index ``start`` on: all of it, or only what came since the
        last call (``start`` is then where the last call stopped); indices are the answer's."""
        if self._end is not None:
            return self._end
        i, n = self._pos - start, len(text)
        while i < n:
            c = text[i]
            i += 1
            if self._string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._string = False
            elif c == '"':
                self._string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    self._pos = self._end = start + i
                    return self._end
        self._pos = start + i
        return None


_BLANKS = " \t\r\n"
_SKIPS = {_BLANKS: re.compile(r"[ \t\r\n]*"), _BLANKS + ";": re.compile(r"[ \t\r\n;]*")}
# The characters of a function's name (as the protocol's ``FunctionName`` allows them).
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-")

# How many characters a parser holds without deciding whether they begin a call (blanks, a
# ``<|python_tag|>``, a ``[TOOL_CALLS]``, a function's name, then the opening of the call's
# JSON): when the first ``UNDECIDED_LIMIT`` characters of a would-be call do not decide it, they
# are content. A call's own text (its JSON value) is not bounded by this.
UNDECIDED_LIMIT = 256


class CallParser:
    """What every format's parser shares: the calls found, the content given out, and the
    calls' deltas (each call as two: id, type and name, then the arguments)."""

    def __init__(self, tool_names: Collection[str],
                 new_id: Callable[[], str] = new_call_id) -> None:
        self.tool_names: frozenset[str] = frozenset(tool_names)
        self.calls: list[ToolCallOut] = []
        self._content: list[str] = []
        self._new_id = new_id
        # Characters read by the parser's scans so far: every scan resumes where the last one
        # stopped, so this grows with the answer's length, however it is split (tests check it).
        self.scanned = 0
        self._buffer = ""  # the held text
        # Pieces held after ``_buffer`` inside an open call (its value, or a hermes block),
        # joined to it only when the call closes: appending is not copying what is held.
        self._tail: list[str] = []
        self._tail_len = 0

    @property
    def content(self) -> str:
        """All the content given out so far."""
        return "".join(self._content)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Takes the answer's next piece; returns the content that can go out now and the deltas
        of the calls completed now."""
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """Ends the answer: returns the content and calls held back until now."""
        raise NotImplementedError

    def _skip(self, text: str, i: int, end: int, chars: str = _BLANKS) -> int:
        """The index of the first character of ``text[i:end]`` not among ``chars`` (blanks, or
        blanks and ``;``), ``end`` if none."""
        m = _SKIPS[chars].match(text, i, end)
        j = m.end() if m is not None else i
        self.scanned += j - i + 1
        return j

    def _find_end(self, value: _JsonEnd, text: str, start: int = 0) -> int | None:
        """``value.find(text, start)``, counted."""
        before = value.pos
        end = value.find(text, start)
        self.scanned += value.pos - before
        return end

    def _held_in(self, value: _JsonEnd, text: str) -> bool:
        """In an open call value (``value``): holds ``text`` in ``_tail`` and says True while
        the value stays open; once it closes, the tail (``text`` too) joins ``_buffer``."""
        start = len(self._buffer) + self._tail_len
        self._tail.append(text)
        self._tail_len += len(text)
        if self._find_end(value, text, start) is None:
            return True
        self._untail()
        return False

    def _untail(self) -> None:
        """The held pieces joined to ``_buffer`` (once)."""
        if self._tail:
            self._buffer += "".join(self._tail)
            self._tail, self._tail_len = [], 0

    def _emit(self, pieces: list[str]) -> str:
        text = "".join(pieces)
        if text:
            self._content.append(text)
        return text

    def _add(self, calls: list[tuple[str, str]], deltas: list[ToolCallDelta]) -> None:
        for name, arguments in calls:
            index = len(self.calls)
            call = ToolCallOut(id=self._new_id(),
                               function=FunctionCallOut(name=name, arguments=arguments))
            self.calls.append(call)
            deltas.append(ToolCallDelta(index=index, id=call.id, type="function",
                                        function=FunctionDelta(name=name, arguments="")))
            deltas.append(ToolCallDelta(index=index, function=FunctionDelta(arguments=arguments)))


class ToolCallParser(CallParser):
    """The ``hermes`` format's parser: splits one answer, fed in pieces as it is generated, into
    content and tool calls.

    Text outside ``<tool_call>...</tool_call>`` is content, given out as soon as it cannot be the
    beginning of ``<tool_call>``. A block's text is held (as its pieces) until its
    ``</tool_call>``; then its JSON (a list of calls or one call) is read: every element must
    be an object with a ``"name"`` among ``tool_names`` and ``"arguments"`` an object (or a
    JSON string of one). A block that reads so gives its calls (each one as two deltas: id,
    type and name, then the arguments); any other block is given out as content, tags and all,
    so nothing is lost.

    Splitting the same answer differently gives the same content and calls (but for the ids);
    each piece is read once (``scanned``), with at most the tag's length before it.
    """

    def __init__(self, tool_names: Collection[str],
                 new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(tool_names, new_id)
        self._inside = False  # in a block: _buffer (and _tail) hold its text after the open tag
        self._scanned = 0  # in a block: _buffer[:_scanned] holds no close tag
        self._edge = ""  # in a block: its last characters, which may begin the close tag

    def _held(self, text: str) -> bool:
        """In a block: holds ``text`` in ``_tail`` and says True while no close tag comes (only
        ``text`` and the block's last characters are searched); else joins the tail to
        ``_buffer``, the search to resume just before ``text``."""
        probe = self._edge + text
        found = probe.find(TOOL_CALL_CLOSE)
        start = len(self._buffer) + self._tail_len - len(self._edge)
        if found < 0:
            self.scanned += len(probe)
            self._tail.append(text)
            self._tail_len += len(text)
            self._edge = probe[max(0, len(probe) - len(TOOL_CALL_CLOSE) + 1):]
            return True
        self._untail()
        self._buffer += text
        self._scanned = start
        return False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Takes the answer's next piece; returns the content that can go out now and the deltas
        of the calls completed now."""
        if self._inside:
            if self._held(text):
                return "", []
        else:
            self._buffer += text
        out: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if not self._inside:
                self.scanned += len(self._buffer)  # held: at most a piece of the tag
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
                self.scanned += (len(self._buffer) if end < 0 else end) - self._scanned
                if end < 0:
                    self._scanned = max(0, len(self._buffer) - len(TOOL_CALL_CLOSE) + 1)
                    self._edge = self._buffer[self._scanned:]
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
        self._untail()
        if self._inside:
            raw = TOOL_CALL_OPEN + self._buffer
            cut = _partial_tag(self._buffer, TOOL_CALL_CLOSE)  # an answer cut inside the tag
            text = self._block(self._buffer[:len(self._buffer) - cut], raw, deltas)
        else:
            text = self._buffer
        self._buffer, self._inside, self._scanned, self._edge = "", False, 0, ""
        return self._emit([text]), deltas

    def _block(self, block: str, raw: str, deltas: list[ToolCallDelta]) -> str:
        """Reads one block: adds its calls and their deltas and returns "", or returns ``raw``
        (the block's original text) when it is not a list of valid calls."""
        calls = _read_calls(block, self.tool_names)
        if calls is None:
            return raw
        self._add(calls, deltas)
        return ""


HermesToolCallParser = ToolCallParser


class _StateParser(CallParser):
    """A parser run by states over ``_buffer`` (``_run``): the JSON formats' (``llama3_json``,
    ``mistral``). While a call's value is open (state ``value``), a piece is held in the tail
    until the value closes; ``finish`` gives out what is still held as content."""

    def __init__(self, tool_names: Collection[str],
                 new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(tool_names, new_id)
        self._state = "start"
        self._value: _JsonEnd | None = None

    def _run(self, out: list[str], deltas: list[ToolCallDelta], final: bool) -> None:
        raise NotImplementedError

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self._state == "value" and self._value is not None:
            if self._held_in(self._value, text):  # the value stays open
                return "", []
        else:
            self._buffer += text
        out: list[str] = []
        deltas: list[ToolCallDelta] = []
        self._run(out, deltas, final=False)
        return self._emit(out), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        self._untail()
        out: list[str] = []
        deltas: list[ToolCallDelta] = []
        self._run(out, deltas, final=True)
        out.append(self._buffer)
        self._buffer, self._state, self._value = "", "content", None
        return self._emit(out), deltas


class Llama3JsonToolCallParser(_StateParser):
    """The ``llama3_json`` format's parser: an answer that begins (after blanks and an optional
    ``<|python_tag|>``) with a JSON object ``{"name": ..., "parameters": {...}}`` (or
    ``"arguments"``), or a JSON list of them, is calls; more may follow, each after blanks or
    ``;`` (and optionally ``<|python_tag|>``). Each value is read as it closes: calls of
    declared functions with object arguments give their calls (their deltas go out then);
    anything else, and everything after it, is content as it was. An answer that begins with
    anything else is content from its first character: it goes out as it comes, but for
    blanks at its start (and what may be the beginning of ``<|python_tag|>``), held until
    decided, ``UNDECIDED_LIMIT`` characters at most (then they are content). Blanks and ``;``
    between calls, and after the last, are dropped.

    Splitting the same answer differently gives the same content and calls (but for the ids);
    each piece is read once (``scanned``), whatever was held before it.
    """

    _KEYS = ("parameters", "arguments")

    def __init__(self, tool_names: Collection[str],
                 new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(tool_names, new_id)
        self._state = "start"  # start, after (a call), value, content
        self._value: _JsonEnd | None = None
        self._lead = 0  # value: where the value opens in _buffer
        # start and after: how far the would-be call's beginning is read
        self._phase = "blank"  # blank, tag (``_k`` of it matched), tagged, list, object
        self._pos = 0  # _buffer[:_pos] is read
        self._k = 0
        self._open = 0  # list, object: where the value opens

    def _read_lead(self, buf: str, end: int) -> bool | None:
        """Reads on, from ``_pos`` up to ``end``, the beginning of a call: blanks (after a call
        ``;`` too), an optional ``<|python_tag|>`` and blanks, then ``{"`` or ``[{"`` (blanks
        allowed between). True: it is one (its value opens at ``_open``); False: it is not;
        None: not yet decided."""
        after = self._state == "after"
        while True:
            i = self._pos
            if self._phase == "tag":
                while i < end and self._k < len(PYTHON_TAG):
                    self.scanned += 1
                    if buf[i] != PYTHON_TAG[self._k]:
                        return False
                    i, self._k = i + 1, self._k + 1
                self._pos = i
                if self._k < len(PYTHON_TAG):
                    return None
                self._phase = "tagged"
                continue
            seps = _BLANKS + ";" if after and self._phase == "blank" else _BLANKS
            i = self._pos = self._skip(buf, i, end, seps)
            if i >= end:
                return None
            c = buf[i]
            if self._phase in ("blank", "tagged") and c in "[{":
                self._open, self._pos = i, i + 1
                self._phase = "list" if c == "[" else "object"
            elif self._phase == "blank" and c == PYTHON_TAG[0]:
                self._phase, self._k = "tag", 0
            elif self._phase == "list" and c == "{":
                self._phase, self._pos = "object", i + 1
            else:
                return self._phase == "object" and c == '"'

    def _run(self, out: list[str], deltas: list[ToolCallDelta], final: bool) -> None:
        while True:
            buf = self._buffer
            if self._state == "content":
                self.scanned += len(buf)
                out.append(buf)
                self._buffer = ""
                return
            if self._state in ("start", "after"):
                if self._state == "after" and self._phase == "blank":
                    i = self._skip(buf, 0, len(buf), _BLANKS + ";")
                    if i:  # the separators go (whatever follows them)
                        self._buffer = buf = buf[i:]
                limit = min(len(buf), UNDECIDED_LIMIT)
                opens = self._read_lead(buf, limit)
                if opens is None and (final or len(buf) > limit):
                    opens = False  # never decided: content (at the start, its blanks too)
                if opens is None:
                    return
                if not opens:
                    self._state = "content"
                    continue
                self._state, self._lead, self._value = "value", self._open, _JsonEnd(self._open)
                continue
            # value
            assert self._value is not None
            end = self._find_end(self._value, buf)
            if end is None:
                return  # final: the held text is content (``finish``)
            calls = _read_calls(buf[self._lead:end], self.tool_names, self._KEYS)
            if calls is None:
                self._state = "content"
                continue
            self._add(calls, deltas)
            self._buffer, self._state, self._value = buf[end:], "after", None
            self._phase, self._pos = "blank", 0


class MistralToolCallParser(_StateParser):
    """The ``mistral`` format's parser.

    ``[TOOL_CALLS]`` opens calls anywhere in the answer; the text before it is content. After
    it (blanks allowed): a JSON list of calls ``[{"name": ..., "arguments": {...}}, ...]`` (or
    one call object), or the newer form ``name[ARGS]{...}`` (one call; another follows its own
    ``[TOOL_CALLS]``). The markers are special tokens of Mistral's tokenizers, not in the text
    under ``skip_special_tokens``: so at the answer's start (after blanks) a call list, or a
    declared function's name followed by (``[ARGS]`` and) its arguments object, is read the
    same, and so is another ``name{...}`` right after such a call. Calls must name declared
    functions with object arguments; a marked part that is not calls goes out as content as it
    was (its marker too), and so does a marker-less one. Content goes out as it comes, but for
    what may be the beginning of a marker (or, at the start, of a call), held until decided,
    ``UNDECIDED_LIMIT`` characters at most (then they are content). Blanks between calls, and
    after the last, are dropped. Ids: ``new_mistral_call_id``.

    Splitting the same answer differently gives the same content and calls (but for the ids);
    each piece is read once (``scanned``), whatever was held before it.
    """

    def __init__(self, tool_names: Collection[str],
                 new_id: Callable[[], str] = new_mistral_call_id) -> None:
        super().__init__(tool_names, new_id)
        self._names = sorted(self.tool_names)
        # start, after (a call; ``_bare``: a marker-less name form), marker (``_buffer`` opens
        # with one), value (the call's JSON opens at ``_lead``; ``_name``: the name form's),
        # content
        self._state = "start"
        self._bare = False
        self._name: str | None = None
        self._lead = 0
        self._value: _JsonEnd | None = None
        # start, after and marker: how far the would-be call's beginning is read
        self._phase = "blank"  # blank, bracket, list, object, name, named, args, argued
        self._pos = 0  # _buffer[:_pos] is read
        self._k = 0  # bracket, args: how much of the marker matched
        self._at = 0  # where the would-be call begins (after the blanks)
        self._open = 0  # where its JSON opens, once found
        self._lo, self._hi = 0, 0  # name: the declared names that begin with what is read
        self._found: str | None = None  # named, args, argued: the function's name

    def _begin(self, state: str, pos: int = 0) -> None:
        self._state, self._phase, self._pos, self._k = state, "blank", pos, 0

    def _read_lead(self, buf: str, end: int) -> str | None:
        """Reads on, from ``_pos`` up to ``end``, the beginning of a call: "marker" (a
        ``[TOOL_CALLS]`` at ``_at``; not in state marker), "call" (its JSON opens at ``_open``;
        ``_found``: the function's name in the name form), "content", or None while undecided.

        After blanks: in state marker a ``[`` or ``{`` (the JSON), or a name; in start and
        after a marker, at the start a call list (``[{"``, blanks allowed between), at the start
        and after a marker-less call a name. A name (of a declared function) is followed by
        blanks, optionally ``[ARGS]`` and blanks, then ``{``."""
        state = self._state
        while True:
            phase, i = self._phase, self._pos
            if phase == "name":  # narrowing the declared names that begin with what is read
                names = self._names
                while i < end and buf[i] in _NAME_CHARS:
                    k, c = i - self._at, buf[i]
                    self.scanned += 1

                    def key(name: str, k: int = k) -> str:
                        return name[k] if len(name) > k else ""

                    self._lo = bisect.bisect_left(names, c, self._lo, self._hi, key=key)
                    self._hi = bisect.bisect_right(names, c, self._lo, self._hi, key=key)
                    if self._lo >= self._hi:
                        return "content"
                    i += 1
                self._pos = i
                if i >= end:
                    return None
                if len(names[self._lo]) != i - self._at:  # no name ends here
                    return "content"
                self._phase, self._found = "named", names[self._lo]
                continue
            if phase in ("bracket", "args"):  # matching a marker
                tag = MISTRAL_ARGS if phase == "args" else MISTRAL_CALLS
                while i < end and self._k < len(tag):
                    self.scanned += 1
                    if buf[i] != tag[self._k]:
                        if phase == "bracket" and self._k == 1 and state == "start" \
                                and (buf[i] in _BLANKS or buf[i] == "{"):
                            break  # a call list's bracket
                        return "content"
                    i, self._k = i + 1, self._k + 1
                self._pos = i
                if i >= end:
                    return None
                if self._k == len(tag):
                    if phase == "bracket":
                        return "marker"
                    self._phase = "argued"
                else:
                    self._phase = "list"
                continue
            i = self._pos = self._skip(buf, i, end)
            if i >= end:
                return None
            c = buf[i]
            if phase == "blank":
                self._at = i
                if state == "marker" and c in "[{":
                    self._open, self._found = i, None
                    return "call"
                if c == "[" and state != "marker":
                    self._phase, self._pos, self._k = "bracket", i + 1, 1
                elif c in _NAME_CHARS and (state != "after" or self._bare):
                    self._phase, self._lo, self._hi = "name", 0, len(self._names)
                else:
                    return "content"
            elif phase == "list" and c == "{":
                self._phase, self._pos = "object", i + 1
            elif phase == "object" and c == '"':
                self._open, self._found = self._at, None
                return "call"
            elif phase == "named" and c == "[":
                self._phase, self._pos, self._k = "args", i + 1, 1
            elif phase in ("named", "argued") and c == "{":
                self._open = i
                return "call"
            else:
                return "content"

    def _run(self, out: list[str], deltas: list[ToolCallDelta], final: bool) -> None:
        while True:
            buf = self._buffer
            state = self._state
            if state == "content":
                self.scanned += len(buf)  # held: at most a piece of the marker
                start = buf.find(MISTRAL_CALLS)
                if start >= 0:
                    out.append(buf[:start])
                    self._buffer = buf[start:]
                    self._begin("marker", len(MISTRAL_CALLS))
                    continue
                keep = 0 if final else _partial_tag(buf, MISTRAL_CALLS)
                out.append(buf[:len(buf) - keep])
                self._buffer = buf[len(buf) - keep:]
                return
            if state in ("start", "after", "marker"):
                if state == "after" and self._phase == "blank":
                    i = self._skip(buf, 0, len(buf))
                    if i:  # the blanks after a call go (whatever follows them)
                        self._buffer = buf = buf[i:]
                limit = min(len(buf), UNDECIDED_LIMIT)
                got = self._read_lead(buf, limit)
                if got is None and (final or len(buf) > limit):
                    got = "content"  # never decided
                if got is None:
                    return
                if state == "marker":
                    if got == "call":
                        self._open_value(self._open, self._found)
                    else:  # the marker is content, and what follows it is read as such
                        self._fail(out, len(MISTRAL_CALLS))
                elif got == "marker":
                    out.append(buf[:self._at])  # at the start, the blanks before it
                    self._buffer = buf[self._at:]
                    self._begin("marker", len(MISTRAL_CALLS))
                elif got == "call" and self._found is None:  # a call list at the start
                    self._open_value(self._open, None)
                elif got == "call":  # a name form without its marker: the blanks go
                    self._buffer = buf[self._at:]
                    self._open_value(self._open - self._at, self._found, bare=True)
                else:  # content: at the start all of it (after a call, its blanks went)
                    self._state = "content"
                continue
            # value
            assert self._value is not None
            end = self._find_end(self._value, buf)
            if end is None:
                if final:
                    self._fail(out, len(buf))
                    continue
                return
            text = buf[self._lead:end]
            if self._name is None:
                calls = _read_calls(text, self.tool_names)
            else:
                try:
                    arguments = _loads(text)
                except ValueError:
                    arguments = None
                one = _read_arguments(self._name, arguments)
                calls = None if one is None else [one]
            if calls is None:
                self._fail(out, end)
                continue
            self._add(calls, deltas)
            self._buffer, self._value = buf[end:], None
            self._begin("after")
            self._bare = self._bare and self._name is not None

    def _open_value(self, lead: int, name: str | None, bare: bool = False) -> None:
        self._state, self._lead, self._name = "value", lead, name
        self._value = _JsonEnd(lead)
        self._bare = bare

    def _fail(self, out: list[str], end: int) -> None:
        """The held part up to ``end`` was no call: it is content as it was."""
        out.append(self._buffer[:end])
        self._buffer, self._state, self._value = self._buffer[end:], "content", None


def make_parser(tool_format: str, tool_names: Collection[str]) -> CallParser:
    """A fresh parser of one answer in ``tool_format`` (``TOOL_FORMATS``), calling only
    ``tool_names``."""
    if tool_format == LLAMA3_JSON:
        return Llama3JsonToolCallParser(tool_names)
    if tool_format == MISTRAL:
        return MistralToolCallParser(tool_names)
    return ToolCallParser(tool_names)


def parse_tool_calls(text: str, tool_names: Collection[str],
                     tool_format: str = HERMES) -> tuple[str | None, list[ToolCallOut]]:
    """A whole answer's content and tool calls in ``tool_format``. With calls, the content is
    stripped of the whitespace around them (None when nothing else is left); without, it is
    ``text`` unchanged."""
    parser = make_parser(tool_format, tool_names)
    parser.feed(text)
    parser.finish()
    if not parser.calls:
        return parser.content, []
    return parser.content.strip() or None, parser.calls
