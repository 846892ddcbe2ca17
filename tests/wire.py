"""Protobuf wire bytes written by hand, for inputs a protobuf library would not write itself."""

from __future__ import annotations


def varint(n: int) -> bytes:
    """``n`` (>= 0) as a base-128 varint, low group first."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)
