"""Why a request's bytes did not parse, by field where the wire can tell: a ``string`` whose bytes are not UTF-8.

protobuf's parser refuses a message whose ``string`` field holds bytes that are not UTF-8 and says only that the
message is corrupt. A client library in a language whose strings are bytes (C++, Go) can send one; so can a hand-made
client. A *diagnosis view* of the API (``server.wire_view.derived_pool``: every ``string`` field declared ``bytes``,
same numbers, so the same wire bytes) parses those bytes, and the first string field whose bytes are not UTF-8 is named
by its path, as a validation error names it: ``user_id``, ``recent_behavior_ids[2]``, ``shopper.session_id``,
``categories[1].skus[0].sku_id``. Bytes that the view cannot parse either are corrupt wire format, as before.

Run only on bytes that failed to parse (the request path never pays for it), and bounded by what the parser was given:
the view parses the same bytes under the same message-size limit.
"""

from __future__ import annotations

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


def _was_string(field: descriptor.FieldDescriptor) -> bool:
    return bool(_API.FindFieldByName(field.full_name).type == descriptor.FieldDescriptor.TYPE_STRING)


def misencoded_string(message: type[Message], data: bytes) -> str | None:
    """The path of the first ``string`` field (in field-number order, depth first) whose bytes are not UTF-8, when the
    bytes parse as ``message`` but for that; ``None`` when they do not parse even so (or every string is UTF-8)."""
    view = message_factory.GetMessageClass(_POOL.FindMessageTypeByName(message.DESCRIPTOR.full_name))
    try:
        parsed = view.FromString(data)
    except DecodeError:
        return None
    return _first_misencoded(parsed, "")


def _first_misencoded(message: Any, prefix: str) -> str | None:
    for field, value in message.ListFields():
        name = prefix + field.name
        items = list(enumerate(value)) if field.is_repeated else [(None, value)]
        for index, item in items:
            path = name if index is None else f"{name}[{index}]"
            if field.message_type is not None:
                found = _first_misencoded(item, path + ".")
                if found is not None:
                    return found
            elif isinstance(item, bytes) and _was_string(field):
                try:
                    item.decode("utf-8")
                except UnicodeDecodeError:
                    return path
    return None
