"""Why a request's bytes did not parse, by field where the wire can tell: a ``string`` whose bytes are not UTF-8.

protobuf's parser refuses a message whose ``string`` field holds bytes that are not UTF-8 and says only that the
message is corrupt. A client library in a language whose strings are bytes (C++, Go) can send one; so can a hand-made
client. A *diagnosis view* of the API (``server.wire_view.derived_pool``: every ``string`` field declared ``bytes``,
same numbers, so the same wire bytes) parses those bytes, and the first string field whose bytes are not UTF-8 is named
by its path, as a validation error names it: ``user_id``, ``recent_behavior_ids[2]``, ``shopper.session_id``,
``categories[1].skus[0].sku_id``. Bytes that the view cannot parse either are corrupt wire format, as before.

Run only on bytes that failed to parse (the request path never pays for it), and bounded: at most one more parse of the
same bytes (the failed parse may have stopped at the first bad string; the view's reads them all), and the walk stops
after ``MAX_VISITED`` strings and messages, four times what the largest valid request holds (32 behaviour ids; 256
SKUs in 32 categories, 8 price bands): past that the request is refused as corrupt, as it would be refused for its
counts. Without the bound, 64 KiB of one-byte ids made the diagnosis 23 times the parse
(18.6 ms), and a client flooding such requests slowed every other call (a review, 2026-12-06).

Not named: a singular string sent twice on the wire, first not UTF-8, then valid. The parser refuses the first; the view
keeps only the last value, so the error is the generic one.
"""

from __future__ import annotations

import functools
from typing import Any

from google.protobuf import descriptor, descriptor_pb2, message_factory
from google.protobuf.message import DecodeError, Message

from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server.wire_view import derived_pool

_F = descriptor_pb2.FieldDescriptorProto
_API = pb.DESCRIPTOR.pool


def _strings_as_bytes(field: descriptor_pb2.FieldDescriptorProto) -> None:
    if field.type == _F.TYPE_STRING:
        field.type = _F.TYPE_BYTES


_POOL = derived_pool(_strings_as_bytes)


MAX_VISITED = 4 * (32 + 256 + 32 + 8 + 8)
"""The most strings and messages a diagnosis looks at (the module doc)."""


@functools.cache
def _was_string(full_name: str) -> bool:
    return bool(_API.FindFieldByName(full_name).type == descriptor.FieldDescriptor.TYPE_STRING)


def misencoded_string(message: type[Message], data: bytes) -> str | None:
    """The path of the first ``string`` field (in field-number order, depth first) whose bytes are not UTF-8, when the
    bytes parse as ``message`` but for that; ``None`` when they do not parse even so, when every string is UTF-8, or when
    the message holds more than ``MAX_VISITED`` strings and messages."""
    view = message_factory.GetMessageClass(_POOL.FindMessageTypeByName(message.DESCRIPTOR.full_name))
    try:
        parsed = view.FromString(data)
    except DecodeError:
        return None
    try:
        return _first_misencoded(parsed, "", [MAX_VISITED])
    except _TooMany:
        return None


class _TooMany(Exception):
    pass


def _first_misencoded(message: Any, prefix: str, budget: list[int]) -> str | None:
    for field, value in message.ListFields():
        nested = field.message_type is not None
        if not nested and not _was_string(field.full_name):
            continue  # numbers, enums, floats: nothing to decode (a repeated float is never walked)
        items = value if field.is_repeated else (value,)
        budget[0] -= len(items)  # a whole field at once, before walking it (a generator over every item, tried: 6x the parse)
        if budget[0] < 0:
            raise _TooMany
        name = prefix + field.name
        for index, item in enumerate(items):
            path = f"{name}[{index}]" if field.is_repeated else name
            if nested:
                found = _first_misencoded(item, path + ".", budget)
                if found is not None:
                    return found
            else:
                try:
                    item.decode("utf-8")
                except UnicodeDecodeError:
                    return path
    return None
