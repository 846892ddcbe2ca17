"""The product serving bench's request: a simulated shelf that the server's own validation accepts whole, larger than
the default message limit (hence the bench's 1 MiB), with every SKU's competitor price carried only when known."""

from bench.payload import build_request
from bench.product_serving import product_request
from server.product_validation import parse_product
from server.validation import Limits


def test_the_shelf_request_is_valid_and_needs_the_larger_message_limit() -> None:
    message = product_request(build_request())
    parsed = parse_product(message, Limits(768, 16, 256), now_s=1_790_000_000.0)
    assert len(parsed.categories) == 6 and all(len(c.skus) == 6 for c in parsed.categories) and len(parsed.price_bands) == 3
    assert 64 * 1024 < message.ByteSize() < 1 << 20
    known = [s.HasField("competitor_price") for c in message.categories for s in c.skus]
    assert any(known) and not all(known)
