"""The one request every loader sends, as a message and as a gRPC wire frame.

A gRPC unary request body on HTTP/2 is a length-prefixed message: one byte compression
flag (0), the message length as 4 bytes big-endian, then the serialized protobuf. h2load
posts exactly these bytes; the gRPC stubs send the same message.
"""

from __future__ import annotations

import random
import struct

from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb

ITEM_DIM = 768
METHOD_PATH = "/shopping_agent.v1.ShoppingAgent/RecommendAction"
GRPC_HEADERS = ("content-type: application/grpc", "te: trailers")


def build_request(seed: int = 7) -> pb.RecommendActionRequest:
    """A typical, valid request: 768 finite floats, three recent behaviours, a detail page."""
    rng = random.Random(seed)
    return pb.RecommendActionRequest(
        request_id="bench",
        user_id="user-000042",
        session_id="session-000042-0001",
        item_id="item-0012345",
        item_embedding=[rng.gauss(0.0, 0.05) for _ in range(ITEM_DIM)],
        recent_behavior_ids=["view", "click", "search"],
        page_type=pb.PAGE_TYPE_DETAIL,
        cart_item_count=2,
    )


def grpc_frame(message: bytes) -> bytes:
    """The HTTP/2 DATA payload of a uncompressed gRPC message."""
    return struct.pack(">BI", 0, len(message)) + message
