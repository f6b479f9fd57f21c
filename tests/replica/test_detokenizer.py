"""Incremental detokenization: whole characters only, stop strings across tokens, O(1) windows."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tierserve.replica.detokenizer import IncrementalDetokenizer


class ByteTok:
    """A byte-level decoder: token id = byte value; 256 is a special token."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.calls.append(len(ids))
        data = bytes(i for i in ids if i < 256 or not skip_special_tokens)
        return data.decode("utf-8", errors="replace")


def run(text_bytes: bytes, stop: list[str] | None = None) -> tuple[list[str], str, IncrementalDetokenizer]:
    det = IncrementalDetokenizer(ByteTok(), [ord("x")], stop)
    pieces = [det.add(b) for b in text_bytes]
    pieces.append(det.finish())
    return pieces, "".join(pieces), det


def test_never_emits_half_a_character() -> None:
    s = "héllo → wörld 😀!"
    pieces, text, _ = run(s.encode())
    assert text == s
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_across_tokens_is_not_returned() -> None:
    pieces, text, det = run(b"hello END world", stop=["END"])
    assert text == "hello "
    assert det.stopped == "END"
    assert "E" not in "".join(pieces)


def test_text_that_only_looks_like_a_stop_prefix_is_released() -> None:
    _, text, det = run(b"an ENd of ENDLESS", stop=["END!"])
    assert det.stopped is None
    assert text == "an ENd of ENDLESS"


def test_earliest_stop_string_wins() -> None:
    _, text, det = run(b"abc STOP xyz HALT", stop=["HALT", "STOP"])
    assert (text, det.stopped) == ("abc ", "STOP")


def test_invalid_utf8_does_not_hold_forever() -> None:
    _, text, _ = run(b"ab\xff\xfecd")
    assert text.startswith("ab") and text.endswith("cd")
    assert "\ufffd" in text


def test_truncated_character_at_the_end_is_flushed() -> None:
    _, text, _ = run("é".encode()[:1])
    assert text == "\ufffd"


def test_special_tokens_are_skipped() -> None:
    det = IncrementalDetokenizer(ByteTok(), [], None)
    assert det.add(ord("a")) + det.add(256) + det.add(ord("b")) + det.finish() == "ab"


def test_each_step_decodes_a_bounded_window() -> None:
    tok = ByteTok()
    det = IncrementalDetokenizer(tok, [1, 2, 3, 4, 5, 6, 7, 8], None)
    for _ in range(500):
        det.add(ord("a"))
    assert max(tok.calls) <= 8


@pytest.mark.parametrize("stop", [[""], None])
def test_empty_stop_list_entries_are_ignored(stop: list[str] | None) -> None:
    _, text, det = run(b"abc", stop=stop)
    assert text == "abc" and det.stopped is None


def test_include_stop_keeps_the_matched_stop_string() -> None:
    det = IncrementalDetokenizer(ByteTok(), [ord("x")], ["END"], include_stop=True)
    pieces = [det.add(b) for b in b"hello END world"]
    pieces.append(det.finish())
    assert "".join(pieces) == "hello END" and det.text == "hello END"
    assert det.stopped == "END"


class SpecialTok(ByteTok):
    """``ByteTok`` whose special token 256 reads ``<s>`` when it is not skipped."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join("<s>" if i == 256 else chr(i) for i in ids
                       if i < 256 or not skip_special_tokens)


@pytest.mark.parametrize(("skip", "want"), [(True, "ab"), (False, "a<s>b")])
def test_special_tokens_are_kept_when_not_skipped(skip: bool, want: str) -> None:
    det = IncrementalDetokenizer(SpecialTok(), [ord("x")], skip_special_tokens=skip)
    text = "".join(det.add(t) for t in (ord("a"), 256, ord("b"))) + det.finish()
    assert text == want
