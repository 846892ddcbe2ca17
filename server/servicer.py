"""The ShoppingAgent servicer: validate, encode, infer (batched), decide, answer.

Degrade, don't fail: no model, a full queue, a deadline too short for inference or an
inference error all give the rule engine's answer with its ``source``; only a malformed
request gets an error status.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from core.domain import Context, Decision, DecisionRequest, EngagementReport, OutcomeReport, Source
from core.product import LayerChoice, ProductDecision, ProductRequest
from policy.features import context_of
from policy.product_decision import by_rules as product_by_rules
from server import errors
from server._gen.shopping_agent.v1 import shopping_agent_pb2 as pb
from server.batching import BatcherClosed, BatchModel, MicroBatcher, Overloaded
from server.config import Config
from server.grpc_metrics import InstrumentedRegistrar, MethodMetrics
from server.logs import log_context
from server.metrics import Metrics
from server.models import ModelHolder
from server.product_validation import parse_product
from server.response_wire import recommend_response
from server.validation import InvalidRequest, Limits, parse_engagement, parse_outcome, parse_request
from server.wire_diagnosis import misencoded_string
from server.wire_view import view_of
from weights.model_set import ModelSet, NoModel

if TYPE_CHECKING:
    from experience.recorder import ExperienceRecorder

log = logging.getLogger(__name__)


class Malformed:
    """Stands in for a request whose bytes do not parse, so the servicer can answer INVALID_ARGUMENT: ``field`` is the
    string whose bytes are not UTF-8 (``server.wire_diagnosis``), or ``None`` when the wire format itself is corrupt."""

    __slots__ = ("field",)

    def __init__(self, field: str | None = None) -> None:
        self.field = field

    def error(self, name: str) -> InvalidRequest:
        """The error to answer, for a request that should have been a ``name``."""
        if self.field is not None:
            return InvalidRequest(self.field, "must be UTF-8 text (a protobuf string), got bytes that are not")
        return InvalidRequest("request", f"not a {name} (wire format is corrupt)")


Message = TypeVar("Message", pb.RecommendActionRequest, pb.ReportOutcomeRequest, pb.ReportEngagementRequest,
                  pb.RecommendProductRequest)
Parsed = TypeVar("Parsed", OutcomeReport, EngagementReport, ProductRequest)
Wire = TypeVar("Wire")  # what a deserializer hands the servicer: a message, or a message with its view


def wire_parser(message: type[Message]) -> Callable[[bytes], Message | Malformed]:
    """The request deserializer for ``message``: corrupt bytes become a ``Malformed`` the servicer answers."""
    def parse(data: bytes) -> Message | Malformed:
        try:
            return message.FromString(data)
        except DecodeError:
            return Malformed(misencoded_string(message, data))

    return parse


class Viewed(NamedTuple, Generic[Message]):
    """A request with embeddings: the message, and the same bytes as its wire view (``server.wire_view``; ``None`` when
    they do not parse as one, which only means reading each embedding through its container)."""

    message: Message
    view: Any


def viewed_parser(message: type[Message]) -> Callable[[bytes], Viewed[Message] | Malformed]:
    """``wire_parser`` for a request with embeddings: the message and its wire view."""
    view_class, parse_message = view_of(message), wire_parser(message)

    def parse(data: bytes) -> Viewed[Message] | Malformed:
        parsed = parse_message(data)
        if isinstance(parsed, Malformed):
            return parsed
        try:
            view = view_class.FromString(data)
        except DecodeError:  # (not seen: the view's only change, bytes for packed floats, parses whatever the message does)
            view = None
        return Viewed(parsed, view)

    return parse


# Each method's request deserializer. The two with embeddings also parse the bytes as their wire view, which reads each
# embedding with one np.frombuffer (server.wire_view): RecommendAction +7.2 % and +4.0 % req/s in two A/Bs.
REQUEST_PARSERS: dict[str, Callable[[bytes], Any]] = {
    "RecommendAction": viewed_parser(pb.RecommendActionRequest),
    "ReportOutcome": wire_parser(pb.ReportOutcomeRequest),
    "ReportEngagement": wire_parser(pb.ReportEngagementRequest),
    "RecommendProduct": viewed_parser(pb.RecommendProductRequest),
}


def add_to_server(servicer: ShoppingAgentServicer, server: InstrumentedRegistrar) -> None:
    """Register the service with a deserializer that turns corrupt bytes into INVALID_ARGUMENT.

    (The generated ``add_ShoppingAgentServicer_to_server`` would let the protobuf error
    escape as UNKNOWN with the parser's message.)
    """
    service = pb.DESCRIPTOR.services_by_name["ShoppingAgent"].full_name
    handlers = {
        "RecommendAction": grpc.unary_unary_rpc_method_handler(  # records its own transport metrics (hot path)
            servicer.RecommendAction,
            request_deserializer=REQUEST_PARSERS["RecommendAction"],
            response_serializer=passthrough,  # the handler answers with the wire bytes (server.response_wire)
        ),
        "ReportOutcome": server.instrument(service, "ReportOutcome", grpc.unary_unary_rpc_method_handler(
            servicer.ReportOutcome,
            request_deserializer=REQUEST_PARSERS["ReportOutcome"],
            response_serializer=pb.ReportOutcomeResponse.SerializeToString,
        )),
        "ReportEngagement": server.instrument(service, "ReportEngagement", grpc.unary_unary_rpc_method_handler(
            servicer.ReportEngagement,
            request_deserializer=REQUEST_PARSERS["ReportEngagement"],
            response_serializer=pb.ReportEngagementResponse.SerializeToString,
        )),
        "RecommendProduct": server.instrument(service, "RecommendProduct", grpc.unary_unary_rpc_method_handler(
            servicer.RecommendProduct,
            request_deserializer=REQUEST_PARSERS["RecommendProduct"],
            response_serializer=pb.RecommendProductResponse.SerializeToString,
        )),
    }
    generic = grpc.method_handlers_generic_handler(service, handlers)
    server.add_generic_rpc_handlers((generic,), counted=True)
    server.add_registered_method_handlers(service, handlers, counted=True)


def passthrough(response: bytes) -> bytes:
    """The response serializer of a method whose handler writes its own wire bytes (``server.response_wire``)."""
    return response


def _choice(choice: LayerChoice, candidate_id: str) -> pb.LayerChoice:
    return pb.LayerChoice(id=candidate_id, index=choice.index, propensity=choice.propensity,
                          source=pb.DecisionSource.ValueType(choice.source), votes=choice.votes, rule=choice.rule)


def product_response(req: ProductRequest, decision: ProductDecision, decision_id: str) -> pb.RecommendProductResponse:
    category = req.categories[decision.category.index]
    return pb.RecommendProductResponse(
        decision_id=decision_id,
        category=_choice(decision.category, category.category_id),
        sku=_choice(decision.sku, category.skus[decision.sku.index].sku_id),
        price_band=_choice(decision.price_band, req.price_bands[decision.price_band.index].band_id),
        joint_propensity=decision.joint_propensity, model_version=decision.model_version, request_id=req.shopper.request_id)


Out = TypeVar("Out", Decision, ProductDecision)
Req = TypeVar("Req", DecisionRequest, ProductRequest)


class ShoppingAgentServicer:
    def __init__(self, config: Config, models: ModelHolder, batcher: MicroBatcher[DecisionRequest, Decision],
                 product_batcher: MicroBatcher[ProductRequest, ProductDecision], metrics: Metrics | None,
                 recorder: ExperienceRecorder | None = None) -> None:
        self._config = config
        self._recorder = recorder
        self._tz = config.tz
        self._models = models
        self._batcher = batcher
        self._product_batcher = product_batcher
        self._metrics = metrics
        self._min_budget_s = config.min_inference_budget_ms / 1000.0
        self._limits_cache = Limits(models.current.item_dim, config.max_recent_behavior_ids, config.max_id_length,
                                    config.max_outcome_value)
        service = pb.DESCRIPTOR.services_by_name["ShoppingAgent"].full_name
        self._rpc = MethodMetrics(metrics, "unary", service, "RecommendAction") if metrics is not None else None
    def _limits(self, item_dim: int) -> Limits:
        if self._limits_cache.item_dim != item_dim:  # a swapped-in bundle with another item dimension
            self._limits_cache = Limits(item_dim, self._config.max_recent_behavior_ids, self._config.max_id_length,
                                        self._config.max_outcome_value)
        return self._limits_cache

    async def RecommendAction(  # noqa: N802 - the gRPC method name
        self, request: Viewed[pb.RecommendActionRequest] | Malformed, context: aio.ServicerContext  # type: ignore[type-arg]
    ) -> bytes:  # a RecommendActionResponse, written by server.response_wire
        metrics, rpc = self._metrics, self._rpc
        if metrics is None or rpc is None:
            return await self._recommend(request, context)
        rpc.started.inc()
        started, code = time.perf_counter(), "UNKNOWN"
        metrics.inflight_count += 1
        if metrics.inflight_tracked:
            metrics.inflight.inc()
        try:
            response = await self._recommend(request, context)
            code = "OK"
            return response
        except aio.AbortError:  # the call was answered with an error status (a malformed request)
            status = context.code()
            code = status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
            raise
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            metrics.inflight_count -= 1
            if metrics.inflight_tracked:
                metrics.inflight.dec()
            rpc.finish(code, started)

    async def _recommend(self, request: Viewed[pb.RecommendActionRequest] | Malformed,
                         context: aio.ServicerContext) -> bytes:  # type: ignore[type-arg]
        model = self._models.current  # read once: validated against, and answered by, this model set
        try:
            if isinstance(request, Malformed):
                raise request.error("RecommendActionRequest")
            req = parse_request(request.message, self._limits(model.item_dim), time.time(), view=request.view)
            try:
                ctx = context_of(req, self._tz)
            except (OverflowError, ValueError, OSError):  # a legal Timestamp the local calendar cannot hold
                raise InvalidRequest("event_time", f"cannot be placed in the server's timezone {self._tz.key}") from None
        except InvalidRequest as exc:
            await errors.abort(context, exc)  # raises grpc's AbortError ...
            raise exc from None  # ... so this only keeps type checkers informed
        canary = self._models.canary
        if canary is not None:  # its share of the sessions, when it reads what the request was validated for
            model = canary.choose(model, req.session_id)
        decision_id = os.urandom(16).hex()  # 128 random bits, as uuid4 has, at a fifth of the cost
        log_context.set({"decision_id": decision_id, "request_id": req.request_id})  # this call's task only
        try:
            decision = await self._decide(model, req, ctx, decision_id, context.time_remaining())
            if self._metrics is not None:  # every answered decision counted here, once, whoever made it
                self._metrics.decision_served(decision)
            if self._recorder is not None:  # before answering: an answered decision is a logged one
                self._recorder.decision(req, ctx.hour, decision, decision_id,
                                        model.encoder.spec if isinstance(model, ModelSet) else None)
            return recommend_response(decision, decision_id, req.request_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug: answer INTERNAL without the exception's text, log it once
            log.exception("RecommendAction failed", extra={"fields": {"decision_id": decision_id}})
            await errors.abort(context, exc)
            raise

    async def ReportOutcome(  # noqa: N802 - the gRPC method name
        self, request: pb.ReportOutcomeRequest | Malformed, context: aio.ServicerContext  # type: ignore[type-arg]
    ) -> pb.ReportOutcomeResponse:
        report = await self._validated(request, context, parse_outcome, "ReportOutcomeRequest")
        if self._metrics is not None:
            self._metrics.outcome_received(report.outcome)
        logged = self._recorder.outcome(report) if self._recorder is not None else False
        return pb.ReportOutcomeResponse(outcome_id=report.outcome_id, logged=logged)

    async def ReportEngagement(  # noqa: N802 - the gRPC method name
        self, request: pb.ReportEngagementRequest | Malformed, context: aio.ServicerContext  # type: ignore[type-arg]
    ) -> pb.ReportEngagementResponse:
        report = await self._validated(request, context, parse_engagement, "ReportEngagementRequest")
        if self._metrics is not None:
            self._metrics.engagement_received(report)
        logged = self._recorder.engagement(report) if self._recorder is not None else False
        return pb.ReportEngagementResponse(engagement_id=report.engagement_id, logged=logged)

    async def RecommendProduct(  # noqa: N802 - the gRPC method name
        self, request: Viewed[pb.RecommendProductRequest] | Malformed, context: aio.ServicerContext  # type: ignore[type-arg]
    ) -> pb.RecommendProductResponse:
        model = self._models.current  # read once: validated against, and answered by, this model set
        limits = self._limits(model.item_dim)
        req = await self._validated(request, context, lambda m, _, now: parse_product(m.message, limits, now, view=m.view),
                                    "RecommendProductRequest")
        try:
            ctx = context_of(req.shopper, self._tz)
        except (OverflowError, ValueError, OSError):  # a legal Timestamp the local calendar cannot hold
            await errors.abort(context, InvalidRequest("shopper.event_time", f"cannot be placed in the server's timezone {self._tz.key}"))
            raise
        canary = self._models.canary
        if canary is not None:
            model = canary.choose(model, req.shopper.session_id)
        decision_id = os.urandom(16).hex()
        try:
            decision = await self._decide_product(model, req, ctx, decision_id, context.time_remaining())
            if self._metrics is not None:
                self._metrics.product_served(decision)
            if self._recorder is not None:  # before answering: an answered decision is a logged one
                self._recorder.product(req, ctx.hour, decision, decision_id, model.encoder.spec if isinstance(model, ModelSet) else None)
            return product_response(req, decision, decision_id)
        except Exception as exc:  # a bug: answer INTERNAL without the exception's text, log it once
            log.exception("RecommendProduct failed", extra={"fields": {"decision_id": decision_id}})
            await errors.abort(context, exc)
            raise

    async def _decide_product(self, model: ModelSet | NoModel, req: ProductRequest, ctx: Context, decision_id: str,
                              remaining_s: float | None) -> ProductDecision:
        """The layers from the bundle's product networks, micro-batched with other RecommendProduct calls as
        RecommendAction's are (its own batcher: a batch runs one model's graphs); its rules when it has none or no bundle
        is loaded, and the rules with ``FALLBACK_DEGRADED`` when inference cannot answer (a full queue, the deadline,
        shutdown, an error). Those are counted by their layers' source, not in degraded_decisions_total: that counter's
        alert divides by RecommendAction's decisions, which a product request never adds to."""
        if not isinstance(model, ModelSet) or model.product is None:  # the rules answer whatever the deadline: nothing degraded
            return product_by_rules(req, model.version)
        decision = await self._batched(self._product_batcher, model.product_batches, req, ctx, decision_id, remaining_s)
        return product_by_rules(req, model.version, Source.FALLBACK_DEGRADED) if isinstance(decision, str) else decision

    async def _validated(self, request: Wire | Malformed, context: aio.ServicerContext,  # type: ignore[type-arg]
                         parse: Callable[[Wire, Limits, float], Parsed], name: str) -> Parsed:
        """The request ``parse`` validated, or the call answered INVALID_ARGUMENT naming the field."""
        try:
            if isinstance(request, Malformed):
                raise request.error(name)
            return parse(request, self._limits_cache, time.time())
        except InvalidRequest as exc:
            await errors.abort(context, exc)  # raises grpc's AbortError ...
            raise exc from None  # ... so this only keeps type checkers informed

    async def _decide(self, model: ModelSet | NoModel, req: DecisionRequest, ctx: Context, decision_id: str,
                      remaining_s: float | None) -> Decision:
        """The decision for one request, from the batcher or the rules (the caller counts it, once)."""
        if not model.ready:
            return model.fallback(ctx, Source.FALLBACK_NO_MODEL)
        decision = await self._batched(self._batcher, model, req, ctx, decision_id, remaining_s)
        return self._degraded(model, ctx, decision) if isinstance(decision, str) else decision

    async def _batched(self, batcher: MicroBatcher[Req, Out], model: BatchModel[Req, Out],
                       req: Req, ctx: Context, decision_id: str, remaining_s: float | None) -> Out | str:
        """``req`` decided in a micro-batch, or why inference cannot answer in time (``overload``, ``deadline``,
        ``shutdown``, ``error``): the caller answers by its rules (a reason, not a callback: no closure per call)."""
        if remaining_s is not None and remaining_s < self._min_budget_s:
            return "deadline"
        try:
            if remaining_s is None:
                return await batcher.decide(model, req, ctx, decision_id)
            # answer with the rules before the caller's deadline rather than not at all
            budget_s = remaining_s - self._min_budget_s
            give_up_at = asyncio.get_running_loop().time() + budget_s
            pending = batcher.decide(model, req, ctx, decision_id, give_up_at)
            async with asyncio.timeout(budget_s):  # no extra Task, unlike wait_for
                return await pending
        except Overloaded:
            return "overload"
        except TimeoutError:
            return "deadline"
        except BatcherClosed:
            return "shutdown"
        except Exception as exc:
            log.warning("inference failed; answering from the rule engine",
                        extra={"fields": {"decision_id": decision_id, "error": repr(exc)[:300]}})
            return "error"

    def _degraded(self, model: ModelSet | NoModel, ctx: Context, reason: str) -> Decision:
        if self._metrics is not None:
            self._metrics.degraded_by(reason)
        return model.fallback(ctx, Source.FALLBACK_DEGRADED)
