"""A walk over a pickle's opcodes, run before any pickle read from a checkpoint file is unpickled.

CPython's unpickler sizes its memo table by the largest index a PUT names (LONG_BINPUT takes 4 bytes, PUT a decimal
of any length): the 7 bytes `}r` + LONG_BINPUT 2**31 + `.` make it allocate and clear 32 GiB, and one flipped bit in a
file without a checksum can do the same (a LONG_BINPUT of 1393191011 got a fuzz run OOM-killed). A pickler numbers
its memo entries 0, 1, 2, ... in order, so `walk` refuses a PUT index beyond the entries put so far: the table then
stays within twice the number of opcodes. (A GET allocates nothing; one of an entry never put the unpickler refuses.)

The walk is exact: it steps from opcode to opcode the way CPython's unpickler reads them (a fixed-size argument, a
length-prefixed one, one or two newline-terminated lines), so it sees every memo opcode the unpickler would execute.
It builds nothing: arguments are skipped by their length. `pickletools.genops` does the same walk but decodes every
argument into an object, several times slower; here the opcodes are classified in one pass at C speed
(`bytes.translate`) and the loop does a comparison and an addition for most of them.
"""

from __future__ import annotations

import pickletools
import struct

from ckpttools.errors import CorruptCheckpointError, short


class Damaged(ValueError):
    """The pickle cannot be what a pickler wrote (the message says why)."""


class Truncated(Damaged):
    """The pickle runs past the end of the bytes given. `at`: where the walk can resume, an offset into the same
    bytes that may lie beyond their end (an argument the walk skips need not be at hand); `puts`: the memo entries
    put so far."""

    def __init__(self, at: int, puts: int) -> None:
        super().__init__("truncated: no STOP opcode before the end")
        self.at, self.puts = at, puts


# Each opcode's class, by its byte: below _FIXED the opcode's length with its fixed-size argument (GETs included),
# else one of the kinds after it.
_FIXED = 16
_BINPUT, _LONG_BINPUT, _MEMOIZE, _PUT, _STOP, _LEN1, _LEN4, _LEN4U, _LEN8U, _LINE, _TWO_LINES, _UNKNOWN = range(
    _FIXED, _FIXED + 12
)
_BY_NAME = {"BINPUT": _BINPUT, "LONG_BINPUT": _LONG_BINPUT, "MEMOIZE": _MEMOIZE, "PUT": _PUT, "STOP": _STOP}
_BY_LENGTH = {
    pickletools.UP_TO_NEWLINE: _LINE,  # GET's decimal among them
    pickletools.TAKEN_FROM_ARGUMENT1: _LEN1,
    pickletools.TAKEN_FROM_ARGUMENT4: _LEN4,
    pickletools.TAKEN_FROM_ARGUMENT4U: _LEN4U,
    pickletools.TAKEN_FROM_ARGUMENT8U: _LEN8U,
}
_HEADER = {_LEN1: 1, _LEN4: 4, _LEN4U: 4, _LEN8U: 8}


def _classes() -> bytes:
    """The translation table, from pickletools' description of the running Python's opcodes."""
    table = bytearray([_UNKNOWN] * 256)
    for op in pickletools.opcodes:
        code = op.code.encode("latin-1")[0]
        if op.name in _BY_NAME:
            table[code] = _BY_NAME[op.name]
        elif op.arg is None:
            table[code] = 1
        elif op.arg.n >= 0:
            table[code] = 1 + op.arg.n
        elif op.arg.name == "stringnl_noescape_pair":  # GLOBAL and INST: module and name, a line each
            table[code] = _TWO_LINES
        else:
            table[code] = _BY_LENGTH[op.arg.n]
    assert max(1 + op.arg.n for op in pickletools.opcodes if op.arg and op.arg.n >= 0) < _FIXED
    return bytes(table)


_CLASSES = _classes()
_U32 = struct.Struct("<I")


def walk(data: bytes, start: int = 0, puts: int = 0) -> int:
    """The offset just after the STOP opcode of the pickle at `data[start:]`, every memo PUT checked.

    `puts`: the memo entries put before `start` (when resuming after `Truncated`).

    Raises:
        Truncated: no STOP before the end of `data`.
        Damaged: an unknown opcode, a negative length, or a memo index beyond the entries put so far.
    """
    classes = data.translate(_CLASSES)
    end, pos, u32 = len(data), start, _U32.unpack_from
    fixed, long_binput, len4u, binput, memoize, stop = _FIXED, _LONG_BINPUT, _LEN4U, _BINPUT, _MEMOIZE, _STOP  # locals
    # One opcode per turn, the common classes first. A fixed-size argument may take `pos` past `end`: the loop ends
    # there, and the walk can resume beyond the end (the bytes skipped are never needed).
    while pos < end:
        kind = classes[pos]
        if kind < fixed:
            pos += kind
        elif kind == long_binput:
            if pos + 5 > end:
                raise Truncated(pos, puts)
            if u32(data, pos + 1)[0] > puts:
                raise _beyond(u32(data, pos + 1)[0], puts)
            puts += 1
            pos += 5
        elif kind == len4u:  # BINUNICODE, BINBYTES
            if pos + 5 > end:
                raise Truncated(pos, puts)
            pos += 5 + u32(data, pos + 1)[0]
        elif kind == binput:
            if pos + 2 > end:
                raise Truncated(pos, puts)
            if data[pos + 1] > puts:
                raise _beyond(data[pos + 1], puts)
            puts += 1
            pos += 2
        elif kind == memoize:
            puts += 1
            pos += 1
        elif kind == stop:
            return pos + 1
        else:
            pos, puts = _rare(data, pos, kind, puts)
    raise Truncated(pos, puts)


def _rare(data: bytes, pos: int, kind: int, puts: int) -> tuple[int, int]:
    """(next opcode's offset, memo entries) after the opcode at `pos` of a kind real checkpoints seldom hold."""
    if kind in _HEADER:
        width = _HEADER[kind]
        if pos + 1 + width > len(data):
            raise Truncated(pos, puts)
        length = int.from_bytes(data[pos + 1 : pos + 1 + width], "little", signed=kind == _LEN4)
        if length < 0:  # BINSTRING, LONG4
            raise Damaged(f"negative length {length} at offset {pos}")
        return pos + 1 + width + length, puts
    if kind in (_LINE, _TWO_LINES, _PUT):
        line_end = data.find(b"\n", pos + 1) + 1
        if kind == _TWO_LINES and line_end:
            line_end = data.find(b"\n", line_end) + 1
        if not line_end:
            raise Truncated(pos, puts)
        if kind == _PUT:
            index = _decimal(data[pos + 1 : line_end - 1])
            if not 0 <= index <= puts:
                raise _beyond(index, puts)
            puts += 1
        return line_end, puts
    raise Damaged(f"unknown opcode {data[pos : pos + 1]!r} at offset {pos}")


def _beyond(index: int, puts: int) -> Damaged:
    return Damaged(f"memo index {short(index)} after {puts} entries")


def _decimal(text: bytes) -> int:
    """A text PUT's index as the unpickler reads it (int() of the line)."""
    try:
        return int(text)
    except ValueError as e:
        raise Damaged(f"memo index {short(text, 40)} is not a number") from e


def check(data: bytes, where: object, what: str = "pickle") -> None:
    """`walk` the pickle `data` holds (the `what` of the file `where`), raising one line naming the file.

    Raises:
        CorruptCheckpointError: the pickle is truncated or damaged (see `walk`).
    """
    try:
        walk(data)
    except Damaged as e:
        raise CorruptCheckpointError(f"{where}: cannot read its {what} ({e}); the file is damaged, re-copy it") from e
