"""The byte-level BPE alphabet (GPT-2's): a printable character for every byte, so that any byte
string is a string of such characters. Torch-free: the ingress uses it too."""

from __future__ import annotations


def byte_chars() -> dict[int, str]:
    """Byte -> its character: visible Latin-1 bytes stand for themselves, the rest map to code
    points from 256 up, in byte order."""
    visible = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in visible}
    extra = 256
    for b in range(256):
        if b not in chars:
            chars[b] = chr(extra)
            extra += 1
    return chars


def char_bytes() -> dict[str, int]:
    """The alphabet reversed: character -> the byte it stands for."""
    return {c: b for b, c in byte_chars().items()}
