"""Tool-call formats without Ray: ``hermes`` (``<tool_call>``), ``llama3_json`` and ``mistral``.

Each format's parser on whole and streamed answers (every split point, character by character
and random chunkings): several calls, malformed JSON, unknown functions, plain answers, and no
marker text in the content however the answer is split. The format detected from templates
that mimic each family's markers (small Jinja templates written here, no download) and from the
default model's own; the prompt side per format (Mistral's 9-character ids in the history,
rendered through a template that checks them); the constrained call's surface form read back
by its format's parser; the config's ``tool_call_parser``; and the ingress end to end over the
stand-in engine (``stub_ingress``), its answer text a Llama 3 or Mistral call.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from typing import Any

import jsonschema
import pytest
from pydantic import ValidationError

from tests.cluster import stub_ingress
from tests.cluster.stub_ingress import StubIngress
from tierserve.cluster.app import ConfigError
from tierserve.cluster.config import ClusterConfig
from tierserve.cluster.protocol import ChatCompletionRequest, ChatMessage, Tool, ToolCallDelta
from tierserve.cluster.structured import structured_output
from tierserve.cluster.tool_calls import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    MISTRAL_CALLS,
    PYTHON_TAG,
    TOOL_CALL_OPEN,
    TOOL_FORMATS,
    UNDECIDED_LIMIT,
    CallParser,
    Llama3JsonToolCallParser,
    MistralToolCallParser,
    ToolCallParser,
    call_output,
    detect_tool_format,
    make_parser,
    mistral_call_id,
    parse_tool_calls,
    render_messages,
    resolve_tool_format,
    tool_system_prompt,
)

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}})
TIME = Tool.model_validate({"type": "function", "function": {"name": "get_time"}})
TOOLS = [WEATHER, TIME]
NAMES = ["get_weather", "get_time"]
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")
MISTRAL_ID = re.compile(r"^[A-Za-z0-9]{9}$")
MARKERS = {HERMES: (TOOL_CALL_OPEN, "</tool_call>"), LLAMA3_JSON: (PYTHON_TAG,),
           MISTRAL: (MISTRAL_CALLS, "[ARGS]")}

Calls = list[tuple[str, dict[str, Any]]]
PARIS: Calls = [("get_weather", {"city": "Paris"})]
BOTH: Calls = [("get_weather", {"city": "Paris"}), ("get_time", {})]


# ---------------------------------------------------------------------------------------------
# Templates that mimic each family's (written here: nothing is downloaded)

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its proper \
arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its \
value}. Do not use variables.

{% for t in tools %}{{ t | tojson }}

{% endfor %}<|eot_id|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}
{%- if message.tool_calls | length != 1 %}
{{- raise_exception("This model only supports single tool-calls at once!") }}
{%- endif %}
{%- set tc = message.tool_calls[0].function %}<|start_header_id|>assistant<|end_header_id|>

{"name": "{{ tc.name }}", "parameters": {{ tc.arguments | tojson }}}<|eot_id|>
{%- elif message.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# Llama 3.1's built-in tools: the answer opens with <|python_tag|>.
LLAMA31_BUILTIN_TEMPLATE = """{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|python_tag|>
{{- message.tool_calls[0].function | tojson }}<|eom_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if tools %}Environment: ipython{% endif %}"""

# Mistral's v3 form: [TOOL_CALLS] and a list; ids must be 9 characters.
MISTRAL_TEMPLATE = """{{- bos_token }}
{%- if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}
{%- if message.role == "user" %}[INST] {{ message.content }}[/INST]
{%- elif message.role == "assistant" and message.tool_calls is defined and message.tool_calls %}
{{- "[TOOL_CALLS] [" }}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.id is not defined or tool_call.id | length != 9 %}
{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
{%- endif %}
{{- '{"name": "' + tool_call.function.name + '", "arguments": ' }}
{{- tool_call.function.arguments | tojson }}{{ ', "id": "' + tool_call.id + '"}' }}
{%- if not loop.last %}, {% endif %}
{%- endfor %}
{{- "]" + eos_token }}
{%- elif message.role == "assistant" %} {{ message.content }}{{ eos_token }}
{%- elif message.role == "tool" %}
{%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}
{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
{%- endif %}
{{- '[TOOL_RESULTS] {"content": ' + (message.content | tojson) + ', "call_id": "' }}
{{- message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}"""

# Mistral's newer form: [TOOL_CALLS]name[ARGS]{...}, one marker per call.
MISTRAL_ARGS_TEMPLATE = """{%- for message in messages %}
{%- if message.role == "user" %}
{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
[INST]{{ message.content }}[/INST]
{%- elif message.role == "assistant" and message.tool_calls %}
{%- for tc in message.tool_calls %}[TOOL_CALLS]{{ tc.function.name }}[ARGS]
{{- tc.function.arguments | tojson }}{% endfor %}{{ eos_token }}
{%- elif message.role == "tool" %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]
{%- else %}{{ message.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}"""

# Hermes / Qwen: <tool_call> tags.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools

<tools>
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# A template that takes tools but shows no format's marker.
PLAIN_TOOLS_TEMPLATE = """{%- if tools %}Tools: {{ tools | tojson }}
{% endif %}{%- for message in messages %}{{ message.role }}: {{ message.content }}
{% endfor %}"""


@pytest.mark.parametrize(("template", "expected"), [
    (LLAMA3_TEMPLATE, LLAMA3_JSON),
    (LLAMA31_BUILTIN_TEMPLATE, LLAMA3_JSON),
    (MISTRAL_TEMPLATE, MISTRAL),
    (MISTRAL_ARGS_TEMPLATE, MISTRAL),
    (HERMES_TEMPLATE, HERMES),
    (PLAIN_TOOLS_TEMPLATE, HERMES),
    ("", HERMES),
    (None, HERMES),
])
def test_format_detected_from_the_template(template: str | None, expected: str) -> None:
    assert detect_tool_format(template) == expected
    assert resolve_tool_format(None, template) == expected


def test_the_default_models_template_is_hermes() -> None:
    from tierserve.replica.models.meta import load_tokenizer

    cfg = ClusterConfig()
    tok = load_tokenizer(cfg.engine.model, cfg.engine.trust_remote_code)
    assert detect_tool_format(tok.chat_template) == HERMES


def test_the_config_names_the_format_over_the_template() -> None:
    for name in TOOL_FORMATS:
        assert ClusterConfig(tool_call_parser=name).tool_call_parser == name
        assert resolve_tool_format(name, MISTRAL_TEMPLATE) == name
    assert ClusterConfig().tool_call_parser is None


@pytest.mark.parametrize("name", ["pythonic", "Hermes", "llama3", ""])
def test_an_unknown_parser_is_a_config_error_listing_the_known(name: str) -> None:
    with pytest.raises(ValidationError) as e:
        ClusterConfig(tool_call_parser=name)
    text = str(e.value)
    assert "tool_call_parser" in text and repr(name) in text
    assert all(known in text for known in TOOL_FORMATS)
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        resolve_tool_format(name, None)


# ---------------------------------------------------------------------------------------------
# The parsers, whole and streamed

W_ARGS = '{"city": "Paris"}'
L_W = f'{{"name": "get_weather", "parameters": {W_ARGS}}}'
L_T = '{"name": "get_time", "parameters": {}}'
M_W = f'{{"name": "get_weather", "arguments": {W_ARGS}}}'
M_T = '{"name": "get_time", "arguments": {}}'

# (format, answer, content, calls)
CASES: list[tuple[str, str, str, Calls]] = [
    # --- llama3_json
    (LLAMA3_JSON, L_W, "", PARIS),
    (LLAMA3_JSON, f"{PYTHON_TAG}{L_W}", "", PARIS),
    (LLAMA3_JSON, f"  \n{PYTHON_TAG} {L_W}\n", "", PARIS),
    (LLAMA3_JSON, f'{{"name": "get_weather", "arguments": {W_ARGS}}}', "", PARIS),
    (LLAMA3_JSON, f"{L_W}; {L_T}", "", BOTH),
    (LLAMA3_JSON, f"{L_W}\n{L_T}\n", "", BOTH),
    (LLAMA3_JSON, f"{L_W};{PYTHON_TAG}{L_T}", "", BOTH),
    (LLAMA3_JSON, f"[{L_W}, {L_T}]", "", BOTH),  # the constrained form
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": "{\\"city\\": \\"Paris\\"}"}', "",
     PARIS),
    (LLAMA3_JSON, f"{L_W}\nIt is sunny.", "It is sunny.", PARIS),
    (LLAMA3_JSON, "It is sunny in Paris.", "It is sunny in Paris.", []),
    (LLAMA3_JSON, "", "", []),
    (LLAMA3_JSON, "  ", "  ", []),
    (LLAMA3_JSON, "; not a call", "; not a call", []),
    (LLAMA3_JSON, f"Sure: {L_W}", f"Sure: {L_W}", []),  # calls only open an answer
    (LLAMA3_JSON, '{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but no call
    (LLAMA3_JSON, '{"name": "get_date", "parameters": {}}',
     '{"name": "get_date", "parameters": {}}', []),  # not declared
    (LLAMA3_JSON, '{"name": "get_time", "parameters": [1]}',
     '{"name": "get_time", "parameters": [1]}', []),
    (LLAMA3_JSON, '{"name": "get_time"}', '{"name": "get_time"}', []),
    (LLAMA3_JSON, '{"name": "get_time", "parameters": {"x": NaN}}',
     '{"name": "get_time", "parameters": {"x": NaN}}', []),
    (LLAMA3_JSON, '{"name": "get_time", "parameters": {]} tail',
     '{"name": "get_time", "parameters": {]} tail', []),  # malformed
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Par',
     '{"name": "get_weather", "parameters": {"city": "Par', []),  # cut off
    (LLAMA3_JSON, f"{L_W}; {{oops}}", "{oops}", PARIS),  # a bad second part is content
    (LLAMA3_JSON, f"{PYTHON_TAG}plain", f"{PYTHON_TAG}plain", []),
    (LLAMA3_JSON, PYTHON_TAG[:6], PYTHON_TAG[:6], []),
    (LLAMA3_JSON, "[1, 2] and {braces}", "[1, 2] and {braces}", []),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "a}]\\"{"}}', "",
     [("get_weather", {"city": 'a}]"{'})]),  # brackets inside strings
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Zürich"}}', "",
     [("get_weather", {"city": "Zürich"})]),
    # --- mistral
    (MISTRAL, f"{MISTRAL_CALLS}[{M_W}]", "", PARIS),
    (MISTRAL, f"{MISTRAL_CALLS} [{M_W}, {M_T}]", "", BOTH),
    (MISTRAL, f"{MISTRAL_CALLS}{M_W}", "", PARIS),
    (MISTRAL, f"[{M_W}, {M_T}]", "", BOTH),  # the marker skipped as a special token
    (MISTRAL, f"  [{M_W}]  ", "", PARIS),
    (MISTRAL, f"Let me check.{MISTRAL_CALLS}[{M_W}]", "Let me check.", PARIS),
    (MISTRAL, f"{MISTRAL_CALLS}get_weather[ARGS]{W_ARGS}", "", PARIS),
    (MISTRAL, f"{MISTRAL_CALLS}get_weather[ARGS]{W_ARGS}{MISTRAL_CALLS}get_time[ARGS]{{}}", "",
     BOTH),
    (MISTRAL, f"get_weather{W_ARGS}get_time{{}}", "", BOTH),  # both markers skipped
    (MISTRAL, f"get_weather {W_ARGS}\nget_time {{}}", "", BOTH),
    (MISTRAL, f"[{M_W}]</s>", "</s>", PARIS),
    (MISTRAL, f"[{M_W}] That is all.", "That is all.", PARIS),
    (MISTRAL, "The weather is fine.", "The weather is fine.", []),
    (MISTRAL, "get the weather", "get the weather", []),
    (MISTRAL, "get_time is a function", "get_time is a function", []),
    (MISTRAL, "", "", []),
    (MISTRAL, "[1, 2] are numbers", "[1, 2] are numbers", []),
    (MISTRAL, "[see above]", "[see above]", []),
    (MISTRAL, "[TOOL", "[TOOL", []),
    (MISTRAL, "text [TOOL_CALL", "text [TOOL_CALL", []),
    (MISTRAL, f"{MISTRAL_CALLS}", f"{MISTRAL_CALLS}", []),
    (MISTRAL, f"{MISTRAL_CALLS}[oops]x", f"{MISTRAL_CALLS}[oops]x", []),  # malformed
    (MISTRAL, f'{MISTRAL_CALLS}[{{"name": "get_time", "arguments": {{]',
     f'{MISTRAL_CALLS}[{{"name": "get_time", "arguments": {{]', []),
    (MISTRAL, f'{MISTRAL_CALLS}[{{"name": "get_date", "arguments": {{}}}}]',
     f'{MISTRAL_CALLS}[{{"name": "get_date", "arguments": {{}}}}]', []),  # not declared
    (MISTRAL, f"{MISTRAL_CALLS}get_date[ARGS]{{}}", f"{MISTRAL_CALLS}get_date[ARGS]{{}}", []),
    (MISTRAL, f"{MISTRAL_CALLS}[{M_W}, {{\"name\": \"nope\", \"arguments\": {{}}}}]",
     f"{MISTRAL_CALLS}[{M_W}, {{\"name\": \"nope\", \"arguments\": {{}}}}]", []),
    (MISTRAL, f"{MISTRAL_CALLS}get_time[ARGS][1]", f"{MISTRAL_CALLS}get_time[ARGS][1]", []),
    (MISTRAL, f"{MISTRAL_CALLS}oops{MISTRAL_CALLS}[{M_T}]", f"{MISTRAL_CALLS}oops",
     [("get_time", {})]),  # a bad part, then a good one
    (MISTRAL, f'{MISTRAL_CALLS}[{M_W}', f'{MISTRAL_CALLS}[{M_W}', []),  # cut off
    # --- hermes, through the same harness
    (HERMES, f"<tool_call>[{M_W}, {M_T}]</tool_call>", "", BOTH),
    (HERMES, f"Sure.<tool_call>{M_W}</tool_call>", "Sure.", PARIS),
    (HERMES, "plain", "plain", []),
    (HERMES, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', []),
    (HERMES, "<tool_call>{bad</tool_call>", "<tool_call>{bad</tool_call>", []),
]


def every_split(text: str) -> list[list[str]]:
    """The text whole, cut at every point, character by character, and in random chunkings."""
    out = [[text], list(text)]
    out += [[text[:k], text[k:]] for k in range(len(text) + 1)]
    rng = random.Random(text)
    for _ in range(10):
        k = min(len(text) - 1, rng.randint(1, 8))
        cuts = sorted(rng.sample(range(1, len(text)), k)) if k > 0 else []
        out.append([text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])])
    return out


def run(parser: CallParser, pieces: list[str]) -> tuple[list[str], list[ToolCallDelta]]:
    content: list[str] = []
    deltas: list[ToolCallDelta] = []
    for piece in [*pieces, None]:
        text, new = parser.feed(piece) if piece is not None else parser.finish()
        content.append(text)
        deltas.extend(new)
    return content, deltas


def got_calls(parser: CallParser) -> Calls:
    return [(c.function.name, json.loads(c.function.arguments)) for c in parser.calls]


@pytest.mark.parametrize(("fmt", "answer", "content", "expected"), CASES)
def test_parser_whole_and_in_every_split(fmt: str, answer: str, content: str,
                                         expected: Calls) -> None:
    for pieces in every_split(answer):
        parser = make_parser(fmt, NAMES)
        out, deltas = run(parser, pieces)
        assert "".join(out) == content, pieces
        assert parser.content == content
        assert got_calls(parser) == expected, pieces
        # Two deltas per call: id, type and name first, then the arguments.
        assert len(deltas) == 2 * len(expected)
        for i, c in enumerate(parser.calls):
            head, body = deltas[2 * i], deltas[2 * i + 1]
            assert head.index == body.index == i and head.id == c.id and head.type == "function"
            assert head.function is not None and head.function.name == c.function.name
            assert body.function is not None and body.function.arguments == c.function.arguments
        if expected and not any(m in content for m in MARKERS[fmt]):
            # No piece of a marker ever went out as content, however the answer was cut.
            for piece in out:
                assert not any(piece.strip() and m.startswith(piece.strip())
                               for m in MARKERS[fmt]), (piece, pieces)
    whole, calls = parse_tool_calls(answer, NAMES, fmt)
    if expected:
        assert whole == (content.strip() or None)
    else:
        assert whole == answer and calls == []


@pytest.mark.parametrize("fmt", [LLAMA3_JSON, MISTRAL])
def test_content_streams_before_it_is_decided(fmt: str) -> None:
    """A plain answer goes out as it comes: only its blanks at the start, or what may begin a
    marker or a call, are held."""
    parser = make_parser(fmt, NAMES)
    assert parser.feed("The ")[0] == "The "
    assert parser.feed("weather")[0] == "weather"
    assert parser.finish() == ("", [])


def test_mistral_holds_a_marker_split_across_deltas() -> None:
    parser = MistralToolCallParser(NAMES)
    assert parser.feed("Checking. [TOOL") == ("Checking. ", [])
    assert parser.feed("_CALL") == ("", [])
    assert parser.feed("S][") == ("", [])
    text, deltas = parser.feed(M_T + "]")
    assert text == "" and len(deltas) == 2
    assert parser.finish() == ("", [])
    assert parser.content == "Checking. "


def test_llama_holds_a_tag_split_across_deltas() -> None:
    parser = Llama3JsonToolCallParser(NAMES)
    assert parser.feed("<|python") == ("", [])
    assert parser.feed("_tag|>") == ("", [])
    text, deltas = parser.feed(L_T)
    assert text == "" and len(deltas) == 2
    assert parser.feed(" And more.") == ("And more.", [])


def test_ids_per_format() -> None:
    answer = "; ".join([L_W, L_T] * 20)
    _, calls = parse_tool_calls(answer, NAMES, LLAMA3_JSON)
    assert len(calls) == 40 and all(CALL_ID.match(c.id) for c in calls)
    _, calls = parse_tool_calls(f"[{', '.join([M_W, M_T] * 20)}]", NAMES, MISTRAL)
    ids = [c.id for c in calls]
    assert len(ids) == 40 and len(set(ids)) == 40
    assert all(MISTRAL_ID.match(i) for i in ids)


def test_no_declared_tools_means_no_calls() -> None:
    for fmt, answer in [(LLAMA3_JSON, L_W), (MISTRAL, f"{MISTRAL_CALLS}[{M_W}]"),
                        (MISTRAL, f"get_weather{W_ARGS}")]:
        assert parse_tool_calls(answer, [], fmt) == (answer, [])


def test_make_parser_by_format() -> None:
    assert type(make_parser(HERMES, NAMES)) is ToolCallParser
    assert type(make_parser(LLAMA3_JSON, NAMES)) is Llama3JsonToolCallParser
    assert type(make_parser(MISTRAL, NAMES)) is MistralToolCallParser


def test_a_long_unclosed_value_is_content_at_the_end() -> None:
    """An answer that opens a value and never closes it (brackets and escaped quotes inside
    its string) is held, then given out whole as content."""
    parser = make_parser(LLAMA3_JSON, NAMES)
    pieces = ['{"name": "get_time", "parameters": {"x": "'] + ["[{ab\\\" "] * 5000
    out, deltas = run(parser, pieces)
    assert "".join(out) == "".join(pieces) and deltas == []


# Answers that stay undecided (or held) piece after piece, in every state a parser can wait in:
# (format, what comes first, the piece repeated).
LONG_NAMES = ["a" * 60 + f"{k:03d}" for k in range(128)]  # 128 names sharing 60 characters
UNDECIDED = [
    (HERMES, "", " "),
    (HERMES, TOOL_CALL_OPEN, " "),
    (HERMES, TOOL_CALL_OPEN + "</tool_cal", "l"),
    (LLAMA3_JSON, "", " "),
    (LLAMA3_JSON, "", "\n"),
    (LLAMA3_JSON, PYTHON_TAG, " "),
    (LLAMA3_JSON, "[", " "),
    (LLAMA3_JSON, "{", " "),
    (LLAMA3_JSON, L_T, " "),
    (LLAMA3_JSON, L_T, ";"),
    (LLAMA3_JSON, L_T + ";{", " "),
    (LLAMA3_JSON, '{"name": "get_time", "parameters": {"x": "', " "),
    (MISTRAL, "", " "),
    (MISTRAL, "[", " "),
    (MISTRAL, "[{", " "),
    (MISTRAL, MISTRAL_CALLS, " "),
    (MISTRAL, "get_weather", " "),
    (MISTRAL, "get_weather[ARGS]", " "),
    (MISTRAL, MISTRAL_CALLS + "get_weather", " "),
    (MISTRAL, "get_time{}", " "),
    (MISTRAL, MISTRAL_CALLS + "[" + M_T + "]", " "),
    (MISTRAL, "x", " "),
    (MISTRAL, MISTRAL_CALLS + '[{"name": "get_time", "arguments": {"x": "', " "),
]


@pytest.mark.parametrize(("fmt", "lead", "piece"), UNDECIDED)
def test_parsers_read_each_piece_once(fmt: str, lead: str, piece: str) -> None:
    """However long an answer stays undecided, fed a character at a time, each feed reads only
    the new text (and a bounded tail): the characters the parser scans grow linearly with the
    answer, not with the square of it; and the text a feed copies (the held string it appends
    to) stays short: a long held call is kept as its pieces. Counted (``scanned``), never
    timed."""
    for names in (NAMES, NAMES + LONG_NAMES):
        parser = make_parser(fmt, names)
        pieces = [lead] + [piece] * 20_000
        out = [parser.feed(lead)[0]]
        for p in pieces[1:]:
            out.append(parser.feed(p)[0])
            assert len(parser._buffer) <= UNDECIDED_LIMIT + len(lead) + len(p)
        out.append(parser.finish()[0])
        answer = "".join(pieces)
        assert parser.scanned <= 4 * len(answer) + 16 * len(pieces), (fmt, lead, piece)
        assert len("".join(out)) <= len(answer)


def test_a_long_declared_name_is_read_a_character_at_a_time() -> None:
    """A Mistral name form whose name shares most of its characters with 127 other declared
    names, fed a character at a time: still a call, still read once."""
    name = LONG_NAMES[77]
    answer = name + '[ARGS]{"x": 1}'
    for pieces in (list(answer), [answer]):
        parser = make_parser(MISTRAL, LONG_NAMES)
        out, _ = run(parser, pieces)
        assert "".join(out) == "" and got_calls(parser) == [(name, {"x": 1})]
        assert parser.scanned <= 4 * len(answer) + 16 * len(pieces)
    parser = make_parser(MISTRAL, LONG_NAMES)
    wrong = "a" * 60 + "999{}"  # shares their 60 characters, names none of them
    out, _ = run(parser, list(wrong))
    assert "".join(out) == wrong and parser.calls == []


BLANKS = " " * (UNDECIDED_LIMIT + 44)
HELD_TOO_LONG = [
    # (format, answer, content, calls): past UNDECIDED_LIMIT undecided characters, content
    (LLAMA3_JSON, BLANKS + L_T, BLANKS + L_T, []),
    (LLAMA3_JSON, "{" + BLANKS + '"name": "get_time", "parameters": {}}',
     "{" + BLANKS + '"name": "get_time", "parameters": {}}', []),
    (LLAMA3_JSON, L_T + ";" + PYTHON_TAG + BLANKS + L_T, PYTHON_TAG + BLANKS + L_T,
     [("get_time", {})]),
    (MISTRAL, BLANKS + "get_time{}", BLANKS + "get_time{}", []),
    (MISTRAL, "get_time" + BLANKS + "{}", "get_time" + BLANKS + "{}", []),
    (MISTRAL, MISTRAL_CALLS + BLANKS + "[" + M_T + "]", MISTRAL_CALLS + BLANKS + "[" + M_T + "]",
     []),
    # a marker is read wherever it comes, content before it or not
    (MISTRAL, BLANKS + MISTRAL_CALLS + "[" + M_T + "]", BLANKS, [("get_time", {})]),
    # just under the bound: still calls
    (LLAMA3_JSON, " " * (UNDECIDED_LIMIT - 2) + L_T, "", [("get_time", {})]),
    (MISTRAL, "get_time" + " " * (UNDECIDED_LIMIT - 9) + "{}", "", [("get_time", {})]),
]


@pytest.mark.parametrize(("fmt", "answer", "content", "expected"), HELD_TOO_LONG)
def test_an_undecided_beginning_is_held_only_so_long(fmt: str, answer: str, content: str,
                                                      expected: Calls) -> None:
    """Nothing is held past ``UNDECIDED_LIMIT`` characters without a decision: the would-be
    call is content from there, the same however the answer is cut."""
    splits = [[answer], list(answer)] + [[answer[:k], answer[k:]]
                                         for k in range(0, len(answer) + 1, 7)]
    for pieces in splits:
        parser = make_parser(fmt, NAMES)
        out, _ = run(parser, pieces)
        assert "".join(out) == content and got_calls(parser) == expected, pieces


# ---------------------------------------------------------------------------------------------
# The prompt side


def msgs(*raw: dict[str, Any]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


def call(name: str, arguments: str, id_: str) -> dict[str, Any]:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


HISTORY = msgs(
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [call("get_weather", W_ARGS, "call_0123456789abcdef01234567"),
                    call("get_time", "{}", "abcDEF123")]},
    {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "sunny"},
    {"role": "tool", "tool_call_id": "abcDEF123", "content": "noon"},
)


def test_mistral_call_ids_are_mapped_to_nine_characters() -> None:
    assert mistral_call_id("abcDEF123") == "abcDEF123"  # already Mistral's
    long = "call_0123456789abcdef01234567"
    mapped = mistral_call_id(long)
    assert MISTRAL_ID.match(mapped) and mapped == mistral_call_id(long)
    others = {mistral_call_id(f"call_{i}") for i in range(1000)}
    assert len(others) == 1000 and all(MISTRAL_ID.match(i) for i in others)
    for odd in ["", "abc-DEF-1", "abcdefghij", "ünïcödé!!"]:
        assert MISTRAL_ID.match(mistral_call_id(odd))


def test_mistral_history_ids_match_between_calls_and_results() -> None:
    rendered, tools = render_messages(HISTORY, TOOLS, "auto", True, MISTRAL)
    assert tools is not None
    ids = [c["id"] for c in rendered[1]["tool_calls"]]
    assert all(MISTRAL_ID.match(i) for i in ids) and ids[1] == "abcDEF123"
    assert [m["tool_call_id"] for m in rendered[2:]] == ids
    # Other formats keep the ids as sent.
    rendered, _ = render_messages(HISTORY, TOOLS, "auto", True, LLAMA3_JSON)
    assert rendered[1]["tool_calls"][0]["id"] == "call_0123456789abcdef01234567"
    assert rendered[2]["tool_call_id"] == "call_0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from tierserve.replica.models.meta import load_tokenizer

    cfg = ClusterConfig()
    return load_tokenizer(cfg.engine.model, cfg.engine.trust_remote_code)


def render(tokenizer: Any, template: str, fmt: str, messages: list[ChatMessage]) -> str:
    rendered, tools = render_messages(messages, TOOLS, "auto", True, fmt)
    text = tokenizer.apply_chat_template(rendered, tools=tools, chat_template=template,
                                         tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str)
    return text


def test_mistral_template_renders_the_history_with_its_ids(tokenizer: Any) -> None:
    text = render(tokenizer, MISTRAL_TEMPLATE, MISTRAL, HISTORY)
    mapped = mistral_call_id("call_0123456789abcdef01234567")
    assert "[AVAILABLE_TOOLS]" in text and '"get_weather"' in text
    assert text.count(f'"id": "{mapped}"') == 1 and text.count(f'"call_id": "{mapped}"') == 1
    assert '"call_id": "abcDEF123"' in text
    assert '"arguments": {"city": "Paris"}' in text
    text = render(tokenizer, MISTRAL_ARGS_TEMPLATE, MISTRAL, HISTORY)
    assert '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}' in text
    # The same history with the ids as sent breaks the template's check.
    rendered, tools = render_messages(HISTORY, TOOLS, "auto", True, HERMES)
    with pytest.raises(Exception, match="length 9"):
        tokenizer.apply_chat_template(rendered, tools=tools, chat_template=MISTRAL_TEMPLATE,
                                      tokenize=False)


def test_llama_template_renders_a_call_and_its_result(tokenizer: Any) -> None:
    history = msgs(
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None,
         "tool_calls": [call("get_weather", W_ARGS, "call_x")]},
        {"role": "tool", "tool_call_id": "call_x", "content": "sunny"},
    )
    text = render(tokenizer, LLAMA3_TEMPLATE, LLAMA3_JSON, history)
    assert '"parameters": dictionary of argument name' in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text
    assert "ipython<|end_header_id|>\n\nsunny" in text


@pytest.mark.parametrize("fmt", TOOL_FORMATS)
def test_plain_template_prompt_and_history_in_the_format(fmt: str) -> None:
    """Without a template that takes tools, the system prompt shows the format's syntax, and
    an earlier call is written back in it: its own parser reads it as the same calls."""
    prompt = tool_system_prompt(TOOLS, fmt)
    assert "<tools>" in prompt and "get_weather" in prompt
    syntax = {HERMES: TOOL_CALL_OPEN, LLAMA3_JSON: '"parameters"', MISTRAL: MISTRAL_CALLS}[fmt]
    assert syntax in prompt
    rendered, tools = render_messages(HISTORY, TOOLS, "auto", False, fmt)
    assert tools is None and rendered[0]["role"] == "system"
    assert rendered[0]["content"] == prompt
    written = rendered[2]["content"]
    content, calls = parse_tool_calls(written, NAMES, fmt)
    assert content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == BOTH
    assert rendered[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


# ---------------------------------------------------------------------------------------------
# Constrained calls: the surface form is what the format's parser reads


@pytest.mark.parametrize("fmt", TOOL_FORMATS)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_constrained_call_reads_back_as_calls(fmt: str, choice: Any) -> None:
    out = call_output(TOOLS, choice, True, fmt)
    key = "parameters" if fmt == LLAMA3_JSON else "arguments"
    instance = ([{"name": "get_time", key: {}}] if isinstance(choice, dict)
                else [{"name": "get_weather", key: {"city": "Paris"}}, {"name": "get_time", key: {}}])
    jsonschema.Draft202012Validator.check_schema(out.schema)
    assert jsonschema.Draft202012Validator(out.schema).is_valid(instance)
    other = "arguments" if key == "parameters" else "parameters"
    assert not jsonschema.Draft202012Validator(out.schema).is_valid(
        [{"name": "get_time", other: {}}])
    assert (out.prefix, out.suffix) == ((TOOL_CALL_OPEN, "</tool_call>") if fmt == HERMES
                                        else ("", ""))
    for sep in (", ", ","):
        text = out.prefix + json.dumps(instance, separators=(sep, ": ")) + out.suffix
        for pieces in every_split(text):
            parser = make_parser(fmt, NAMES)
            content, _ = run(parser, pieces)
            assert "".join(content) == ""
            assert [c.function.name for c in parser.calls] == [i["name"] for i in instance]


@pytest.mark.parametrize("fmt", TOOL_FORMATS)
def test_structured_output_carries_the_formats_surface(fmt: str) -> None:
    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "x"}],
        "tools": [t.model_dump(exclude_none=True) for t in TOOLS], "tool_choice": "required"})
    got = structured_output(body, tool_format=fmt)
    assert got is not None and got.kind == "tool_call"
    expected = call_output(TOOLS, "required", True, fmt)
    assert (got.output.prefix, got.output.suffix) == (expected.prefix, expected.suffix)
    assert json.loads(got.output.spec) == expected.schema


# ---------------------------------------------------------------------------------------------
# End to end through the ingress (the stand-in engine answers a fixed text)

CHAT = "/v1/chat/completions"
TOOL_BODIES = [t.model_dump(exclude_none=True) for t in TOOLS]


def ask(stub: StubIngress, **kw: Any) -> dict[str, Any]:
    return {"model": stub.model, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": TOOL_BODIES, "max_tokens": 32, **kw}


def with_template(monkeypatch: pytest.MonkeyPatch, template: str) -> None:
    """The ingress's tokenizer gets ``template`` as its chat template (patched where the
    ingress's per-model record, ``_Served.load``, reads it)."""
    names = stub_ingress.ingress._Served.load.__func__.__globals__
    load = names["load_tokenizer"]

    def load_with(model: str, trust_remote_code: bool = False) -> Any:
        tok = load(model, trust_remote_code)
        tok.chat_template = template
        return tok

    monkeypatch.setitem(names, "load_tokenizer", load_with)


def answer_calls(body: dict[str, Any]) -> Calls:
    calls = body["choices"][0]["message"]["tool_calls"] or []
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def streamed(events: list[dict[str, Any]]) -> tuple[str, Calls, list[str], str | None]:
    """A stream's content, calls, call ids and last finish reason."""
    text, calls, ids, reason = "", [], [], None
    for e in events:
        for ch in e["choices"]:
            d = ch["delta"]
            text += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                if "id" in tc:
                    ids.append(tc["id"])
                    calls.append((tc["function"]["name"], ""))
                elif tc.get("function", {}).get("arguments"):
                    name, _ = calls[tc["index"]]
                    calls[tc["index"]] = (name, tc["function"]["arguments"])
            reason = ch.get("finish_reason") or reason
    return text, [(n, json.loads(a)) for n, a in calls], ids, reason


@pytest.mark.parametrize(("config", "template", "answer", "id_pattern"), [
    ({}, None, f"<tool_call>[{M_W}, {M_T}]</tool_call>", CALL_ID),  # the default model's
    ({}, HERMES_TEMPLATE, f"<tool_call>\n{M_W}\n</tool_call>\n<tool_call>\n{M_T}\n</tool_call>",
     CALL_ID),
    ({"tool_call_parser": "llama3_json"}, None, f"{PYTHON_TAG}{L_W}; {L_T}", CALL_ID),
    ({}, LLAMA3_TEMPLATE, f"{L_W}\n{L_T}", CALL_ID),
    ({"tool_call_parser": "mistral"}, None, f"{MISTRAL_CALLS}[{M_W}, {M_T}]", MISTRAL_ID),
    ({}, MISTRAL_TEMPLATE, f"[{M_W}, {M_T}]", MISTRAL_ID),
    ({}, MISTRAL_ARGS_TEMPLATE, f"{MISTRAL_CALLS}get_weather[ARGS]{W_ARGS}"
                                f"{MISTRAL_CALLS}get_time[ARGS]{{}}", MISTRAL_ID),
])
def test_an_answer_in_the_models_format_comes_back_as_tool_calls(
        monkeypatch: pytest.MonkeyPatch, config: dict[str, Any], template: str | None,
        answer: str, id_pattern: re.Pattern[str]) -> None:
    if template is not None:
        with_template(monkeypatch, template)
    stub = StubIngress(config)
    monkeypatch.setattr(stub_ingress, "ANSWER", answer)
    got = stub.post(CHAT, ask(stub))
    assert got.status == 200, got.body
    choice = got.body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert answer_calls(got.body) == BOTH
    assert all(id_pattern.match(c["id"]) for c in choice["message"]["tool_calls"])
    got = stub.post(CHAT, ask(stub, stream=True))
    assert got.status == 200, got.body
    text, calls, ids, reason = streamed(got.body)
    # (hermes streams the blanks between its blocks as content, as it always has)
    assert text.strip() == "" and calls == BOTH and reason == "tool_calls"
    assert all(id_pattern.match(i) for i in ids)
    # A plain answer in the same format is content.
    monkeypatch.setattr(stub_ingress, "ANSWER", "It is sunny.")
    got = stub.post(CHAT, ask(stub))
    choice = got.body["choices"][0]
    assert choice["message"]["content"] == "It is sunny."
    assert not choice["message"].get("tool_calls") and choice["finish_reason"] == "stop"


def test_the_mistral_template_gets_nine_character_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """A history whose call ids are OpenAI's renders through a template that demands 9
    characters, and the tools reach the prompt."""
    with_template(monkeypatch, MISTRAL_TEMPLATE)
    stub = StubIngress()
    assert stub.inst.tool_format == MISTRAL and stub.inst.template_takes_tools
    body = ask(stub, messages=[m.model_dump(exclude_none=True) for m in HISTORY])
    got = stub.post(CHAT, body)
    assert got.status == 200, got.body
    prompt = stub.inst.tokenizer.decode(stub.sent[-1].prompt_ids)
    mapped = mistral_call_id("call_0123456789abcdef01234567")
    assert "[AVAILABLE_TOOLS]" in prompt and f'"call_id": "{mapped}"' in prompt


def test_a_llama_template_refusing_two_calls_is_a_400(monkeypatch: pytest.MonkeyPatch) -> None:
    with_template(monkeypatch, LLAMA3_TEMPLATE)
    stub = StubIngress()
    got = stub.post(CHAT, ask(stub, messages=[m.model_dump(exclude_none=True) for m in HISTORY]))
    assert got.status == 400
    err = got.body["error"]
    assert err["code"] == "bad_messages" and err["param"] == "messages"
    assert "single tool-calls" in err["message"]


@pytest.mark.parametrize(("fmt", "prefix", "key"), [
    ("hermes", TOOL_CALL_OPEN, "arguments"), ("llama3_json", "", "parameters"),
    ("mistral", "", "arguments")])
def test_required_tool_choice_constrains_to_the_formats_surface(
        monkeypatch: pytest.MonkeyPatch, fmt: str, prefix: str, key: str) -> None:
    stub = StubIngress({"tool_call_parser": fmt})
    answer = json.dumps([{"name": "get_time", key: {}}])
    monkeypatch.setattr(stub_ingress, "ANSWER", prefix + answer
                        + ("</tool_call>" if fmt == "hermes" else ""))
    got = stub.post(CHAT, ask(stub, tool_choice="required"))
    assert got.status == 200, got.body
    structured = stub.sent[-1].sampling.structured
    assert structured is not None and structured.prefix == prefix
    assert key in json.dumps(json.loads(structured.spec)["items"])
    assert answer_calls(got.body) == [("get_time", {})]


def test_an_unknown_parser_in_the_config_stops_the_ingress() -> None:
    with pytest.raises(ConfigError, match="hermes, llama3_json, mistral"):
        StubIngress({"tool_call_parser": "pythonic"})


# ---------------------------------------------------------------------------------------------
# The constraint through the replica's grammar (the embedded model: random weights, so a call
# comes out only because the mask writes it)

CITY = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}}})


@pytest.fixture(scope="module")
def embedded_llm() -> Any:
    from tierserve.replica.llm import LLM
    from tierserve.replica.models.embedded import EMBEDDED_MODEL

    return LLM(EMBEDDED_MODEL, num_kv_blocks=256, block_size=16, max_num_seqs=16,
               max_model_len=512)


def output_text(out: Any) -> tuple[str, str | None]:
    """An offline answer's text and finish reason (the flat record, or vLLM's shape)."""
    first = out.outputs[0] if hasattr(out, "outputs") else out
    return first.text, first.finish_reason


@pytest.mark.slow
@pytest.mark.parametrize("fmt", TOOL_FORMATS)
def test_the_grammar_writes_what_the_parser_reads(embedded_llm: Any, fmt: str) -> None:
    from tierserve.records import SamplingParams

    body = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "x"}],
        "tools": [t.model_dump(exclude_none=True) for t in (CITY, TIME)],
        "tool_choice": "required", "parallel_tool_calls": False})
    got = structured_output(body, tool_format=fmt)
    assert got is not None
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=seed, structured=got.output)
              for seed in range(4)]
    outs = embedded_llm.generate(["hello"] * 4, params, use_tqdm=False)
    for out in outs:
        text, reason = output_text(out)
        assert reason == "stop", text
        content, calls = parse_tool_calls(text, ["get_weather", "get_time"], fmt)
        assert content is None and len(calls) == 1, text
        args = json.loads(calls[0].function.arguments)
        assert args in ({"city": "Paris"}, {"city": "Rome"}, {}), text
