"""The grammar compiler's own process: one per replica, started by ``Grammars`` on its first
structured request (docs/structured.md, "Compiling in the replica").

The replica sends it its tokenizer's ``xgrammar.TokenizerInfo`` once, then one compile job at a
time; it answers each with the compiled grammar serialized (``CompiledGrammar.serialize_json``)
or the compiler's reason for refusing it. One process serves every engine of its replica's
process (each tokenizer is sent once, under an id its jobs name). A job that runs past the
replica's budget, or a compiler that crashes, costs this process and nothing else: the replica
kills it, answers the request, and starts another for the next job. Its address space is capped
(``cap_memory``), and it refuses to send back a grammar larger than the job's ``max_bytes``.

The channel is a pair of pipes whose descriptors the parent passes on the command line (the
process's stdout stays free for whatever native code prints). Each message is a frame: the
lengths of its head and body (``FRAME``), a JSON head, and a body of raw bytes (a schema, a
regex, a grammar or a serialized compiled grammar).

Run as ``python -m tierserve.replica.grammar_worker READ_FD WRITE_FD HEADROOM_BYTES``. It
imports nothing of tierserve's beyond this module, and xgrammar only once running.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import struct
import sys
import time
from typing import Any

# A frame's lengths: its JSON head's, then its body's.
FRAME = struct.Struct("<IQ")
_CHUNK = 1 << 20


class Timeout(Exception):
    """A read's deadline passed before its frame was whole."""


def write_frame(fd: int, head: dict[str, Any], body: bytes = b"") -> None:
    """Write one frame to ``fd`` (blocking until the pipe took it all)."""
    meta = json.dumps(head).encode()
    view = memoryview(FRAME.pack(len(meta), len(body)) + meta + body)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise Timeout()
        chunk = os.read(fd, min(n - len(buf), _CHUNK))
        if not chunk:
            raise EOFError("the other end of the grammar channel closed")
        buf += chunk
    return bytes(buf)


def read_frame(fd: int, deadline: float | None = None) -> tuple[dict[str, Any], bytes]:
    """One frame from ``fd``: its head and body. ``deadline`` (``time.monotonic``): raise
    ``Timeout`` past it; ``EOFError`` when the writer is gone."""
    size_meta, size_body = FRAME.unpack(_read_exact(fd, FRAME.size, deadline))
    head = json.loads(_read_exact(fd, size_meta, deadline))
    if not isinstance(head, dict):
        raise ValueError("a grammar frame's head must be a JSON object")
    return head, _read_exact(fd, size_body, deadline)


def reason(e: BaseException) -> str:
    """xgrammar's message without its source location (``[time] path.cc:123: reason``)."""
    text = str(e).strip()
    head, sep, tail = text.partition(": ")
    if sep and head.startswith("[") and ".cc:" in head:
        text = tail
    return text.splitlines()[0] if text else type(e).__name__


# How xgrammar writes (as EBNF) the character of a string bounded by minLength/maxLength: it lets
# every control character but CR and LF through raw, which no JSON parser takes. The same
# repetition of plain characters (no escapes, no control characters) costs what the original
# does; a ``pattern`` saying it would cost about 0.36 s per property on a 2-core Xeon (xgrammar
# builds a string pattern's automaton per property: 24 bounded strings took 8.6 s against
# 0.02 s this way).
BOUNDED_CHAR = '[^\\"\\\\\\r\\n]'
PLAIN_CHAR = '[^\\"\\\\\\0-\\x1f]'


def release_freed_memory() -> None:
    """Hand the memory the allocator keeps after large frees back to the system (glibc's
    ``malloc_trim``; nothing elsewhere). A 29 MiB serialized grammar read, parsed and dropped
    left a replica 42 MiB larger until trimmed, and the first structured requests of a replica
    in the cluster about 300 MiB."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def plain_bounded_strings(grammar: Any) -> Any:
    """``grammar`` (an ``xgrammar.Grammar`` made from a JSON schema) with the characters of its
    bounded strings plain (``BOUNDED_CHAR`` written as ``PLAIN_CHAR``); itself when it has
    none."""
    import xgrammar as xgr

    text = str(grammar)
    if BOUNDED_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(BOUNDED_CHAR, PLAIN_CHAR))


def compile_job(compiler: Any, head: dict[str, Any], text: str) -> Any:
    """Compile one job (``head["op"]``: ``json`` with ``text`` a JSON schema, ``json_object``,
    ``regex`` or ``ebnf``) with ``compiler``, an ``xgrammar.GrammarCompiler``."""
    import xgrammar as xgr

    op = head["op"]
    ws = head.get("max_whitespace")
    any_ws = bool(head.get("any_whitespace", True))
    if op == "json":
        grammar = plain_bounded_strings(xgr.Grammar.from_json_schema(
            text, any_whitespace=any_ws, strict_mode=False, max_whitespace_cnt=ws))
        prefix, suffix = head.get("prefix", ""), head.get("suffix", "")
        if prefix or suffix:
            grammar = xgr.Grammar.concat(
                xgr.Grammar.from_ebnf(f"root ::= {json.dumps(prefix, ensure_ascii=False)}"),
                grammar,
                xgr.Grammar.from_ebnf(f"root ::= {json.dumps(suffix, ensure_ascii=False)}"))
        return compiler.compile_grammar(grammar)
    if op == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_ws,
                                            strict_mode=False, max_whitespace_cnt=ws)
    if op == "regex":
        return compiler.compile_regex(text)
    if op == "ebnf":
        return compiler.compile_grammar(text)
    raise ValueError(f"unknown grammar job {op!r}")


def cap_memory(headroom: int) -> None:
    """Let this process's address space grow by ``headroom`` bytes at most from now: a grammar
    that needs more fails here (``MemoryError``, or xgrammar's ``std::bad_alloc``) instead of
    pressing the machine (xgrammar's serialized form of a grammar can be a hundred times its
    size in memory). Nothing where the size cannot be read."""
    import resource

    try:
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = size + headroom
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or "bad_alloc" in str(e)


def run_job(compiler: Any, head: dict[str, Any], text: str) -> tuple[dict[str, Any], bytes]:
    """One job's answer: the grammar serialized, or why not. ``"retire"``: this process used
    more memory than it should keep (the replica starts another for the next job)."""
    t0 = time.perf_counter()
    limit = int(head["max_bytes"])
    try:
        compiled = compile_job(compiler, head, text)
        # Too large to keep, in memory or serialized (what the replica reads): refused.
        size = int(compiled.memory_size_bytes)
        if size > limit:
            return {"ok": False, "too_large": size, "retire": True}, b""
        serialized = compiled.serialize_json()
        if len(serialized) > limit:
            return {"ok": False, "too_large": len(serialized), "retire": True}, b""
        data = serialized.encode()
    except Exception as e:  # xgrammar raises RuntimeError with its parser's message
        if _out_of_memory(e):
            return {"ok": False, "too_large": 0, "retire": True}, b""
        return {"ok": False, "error": reason(e)}, b""
    return {"ok": True, "bytes": size, "seconds": time.perf_counter() - t0}, data


def serve(read_fd: int, write_fd: int, headroom: int) -> int:
    """The worker's loop: ready once xgrammar is imported (``{"ok": true}``), then one frame at
    a time until the replica closes the channel: a tokenizer (``{"op": "tokenizer", "id": ID}``
    with its serialized ``TokenizerInfo`` as body) or a job naming one (``"tokenizer": ID``)
    and the largest grammar it may send back (``"max_bytes"``). ``headroom``: the memory it
    may take beyond what it holds once ready (``cap_memory``; 0: no cap)."""
    import xgrammar as xgr

    if headroom > 0:
        cap_memory(headroom)
    compilers: dict[str, Any] = {}
    write_frame(write_fd, {"ok": True})
    while True:
        try:
            head, body = read_frame(read_fd)
        except EOFError:
            return 0
        if head.get("op") == "tokenizer":
            info = xgr.TokenizerInfo.deserialize_json(body.decode())
            # One thread: the replica's cores belong to its step loop.
            compilers[str(head["id"])] = xgr.GrammarCompiler(info, max_threads=1,
                                                             cache_enabled=False)
            write_frame(write_fd, {"ok": True})
            continue
        compiler = compilers.get(str(head.get("tokenizer")))
        if compiler is None:
            write_frame(write_fd, {"ok": False, "error": "unknown tokenizer"})
            continue
        answer, data = run_job(compiler, head, body.decode())
        write_frame(write_fd, answer, data)


def main(argv: list[str] | None = None) -> int:
    """``READ_FD WRITE_FD [HEADROOM_BYTES]``."""
    args = sys.argv[1:] if argv is None else argv
    return serve(int(args[0]), int(args[1]), int(args[2]) if len(args) > 2 else 0)


if __name__ == "__main__":
    sys.exit(main())
