"""Which pickles the C unpickler may read: a scan of a pickle's opcodes, at the speed of a regex.

Python's own unpickler (``pickle._Unpickler``) spends ~0.5 us an opcode: a DCP ``.metadata`` of
5,000 tensors (530,000 opcodes) takes 0.27 s there, 0.08 s in the C one. But the C unpickler
trusts two numbers a pickle names: it sizes its memo array by the largest index a PUT names (and
clears it: ``LONG_BINPUT`` with a 4-byte index, or a text ``PUT`` with any, makes five bytes
allocate and touch gigabytes, as in 3.11; CPython's gh-115952 later gave sparse indexes a dict),
and it allocates a counted string's size before reading its bytes. Python's unpickler keeps its
memo in a dict and reads before it allocates. So a pickle goes to the C unpickler only where this scan walks all of
its opcodes and finds:

- only opcodes Python's pickler writes at protocols 2-5 for plain data (no text opcodes but
  ``GLOBAL``, no ``PUT``, no extension registry, no out-of-band buffers);
- every ``LONG_BINPUT`` index below the pickle's length (a pickler numbers its memo from 0, one
  entry per object it writes: never more than the pickle has bytes; the memo array is then at
  most 16 bytes a byte of the pickle);
- every counted string, bytes or long inside the pickle; every ``FRAME`` under 4 GiB;
- one ``STOP``, at the last byte.

Runs of fixed-size opcodes and of strings under 256 bytes are matched by one regex (a possessive
repeat of the opcode alternatives, each starting with a distinct opcode byte and of a length its
first bytes fix: a pickle parses one way, so the regex's tokens are the unpickler's); the rest
(longer strings, a ``LONG_BINPUT`` whose index's bytes do not show it below the length) takes a
step of Python each. 11 ms for that ``.metadata`` with every ``LONG_BINPUT`` a step, 7 ms with them in the regex.
"""

from __future__ import annotations

import functools
import re
import sys

#: opcodes of one byte and no argument: MARK POP POP_MARK DUP NONE REDUCE APPEND BUILD DICT
#: EMPTY_DICT APPENDS LIST EMPTY_LIST SETITEM TUPLE EMPTY_TUPLE SETITEMS NEWOBJ TUPLE1-3 NEWTRUE
#: NEWFALSE EMPTY_SET ADDITEMS FROZENSET NEWOBJ_EX STACK_GLOBAL MEMOIZE BINPERSID
_BARE = b"(012NRabd}el]st)u\x81\x85\x86\x87\x88\x89\x8f\x90\x91\x92\x93\x94Q"
#: opcodes with a fixed-size argument: BININT1 BINGET BINPUT (an index under 256) PROTO; BININT2;
#: BININT LONG_BINGET (a GET only looks up); BINFLOAT
_FIXED = {1: b"Khq\x80", 2: b"M", 4: b"Jj", 8: b"G"}
#: a 1-byte count, then that many bytes: SHORT_BINSTRING SHORT_BINBYTES SHORT_BINUNICODE LONG1
_SHORT = b"UC\x8c\x8a"
#: a 4-byte count: BINSTRING BINBYTES BINUNICODE (under 256 bytes in the regex), LONG4; 8-byte
#: counts: BINUNICODE8 BINBYTES8 BYTEARRAY8
_COUNT4 = b"XBT\x8b"
_COUNT8 = b"\x8d\x8e\x96"
_STOP, _LONG_BINPUT = ord("."), ord("r")


def _any_of(ops: bytes) -> bytes:
    return b"[" + b"".join(re.escape(bytes([op])) for op in ops) + b"]"


def _counted(width: int) -> bytes:
    """A count of ``width`` bytes under 256, then that many bytes."""
    return b"(?:" + b"|".join(re.escape(bytes([n]) + bytes(width - 1)) + b".{%d}" % n for n in range(256)) + b")"


@functools.cache
def _runs(put_bytes: int) -> re.Pattern[bytes] | None:
    """The regex of the runs; ``put_bytes``: a ``LONG_BINPUT`` whose index has no more low bytes
    than that (its index below 256 ** put_bytes, which is at most the pickle's length) is one too."""
    if sys.version_info < (3, 11):
        return None  # (a possessive repeat needs 3.11: Python's unpickler reads every pickle there)
    tokens = [_any_of(_BARE)] + [_any_of(ops) + b"." * n for n, ops in _FIXED.items()] + [
        rb"\x95....\x00\x00\x00\x00",  # FRAME (the C unpickler reads its length's bytes, no more)
        rb"c[^\n]*\n[^\n]*\n",  # GLOBAL module\nname\n (find_class decides)
        _any_of(_SHORT) + _counted(1),
        _any_of(b"XBT") + _counted(4),
    ]
    if put_bytes:
        tokens.append(b"r" + b"." * put_bytes + b"\x00" * (4 - put_bytes))
    return re.compile(b"(?:" + b"|".join(tokens) + b")*+", re.DOTALL)


def c_unpickler_may_read(data: bytes) -> bool:
    """Whether every opcode of ``data`` is one the C unpickler reads within a bound of ``data``'s
    size (the module's docstring); False where unsure (then Python's unpickler reads it)."""
    pos, end = 0, len(data)
    runs = _runs(min(3, (end.bit_length() - 1) // 8) if end else 0)  # (256 ** put_bytes <= the length)
    if runs is None:
        return False
    while True:
        pos = runs.match(data, pos).end()
        if pos >= end:
            return False
        op = data[pos]
        if op == _STOP:
            return pos + 1 == end
        if op == _LONG_BINPUT:
            if int.from_bytes(data[pos + 1:pos + 5], "little") >= end:
                return False
            pos += 5
            continue
        width = 4 if op in _COUNT4 else 8 if op in _COUNT8 else 0
        if not width:
            return False
        pos += 1 + width + int.from_bytes(data[pos + 1:pos + 1 + width], "little")
