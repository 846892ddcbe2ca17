"""Prometheus metrics, built on a registry passed in (tests use a fresh one each).

Names follow the conventions SREs already have dashboards for: the go-grpc-prometheus
``grpc_server_*`` family for the transport (see ``server.grpc_metrics``) and
``shopping_agent_*`` for decisions and the model. The request path only increments
pre-created label children: no string formatting, no lock beyond the library's own.

When several worker processes serve one port, prometheus_client's multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``) aggregates them; each gauge declares how
(``multiprocess_mode``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily

from core.domain import ACTIONS, Action, Decision, EngagementReport, Outcome, Source
from core.product import LAYERS, ProductDecision
from experience.kinds import KINDS
from weights.bundle import REASONS

log = logging.getLogger(__name__)

WATCHED_FILES = ("active", "canary")  # the weights volume's files a server watches (weights.store's ACTIVE_NAME and CANARY_NAME)

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
VOTE_BUCKETS = tuple(float(v) for v in range(0, 17))  # K is at most 16
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEGRADED_REASONS = ("overload", "deadline", "shutdown", "error")
LOG_DROP_REASONS = ("queue_full", "write_error", "closed")
ENGAGEMENT_KINDS = ("bounced", "stayed", "unknown")  # by the report's bounce signal: true, false, not measured
DWELL_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
SCROLL_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
MAX_TRAINING_NAMES = 1024
"""With ``--workers`` (multiprocess mode), training-metric names a process exports over its life (twice a bundle's
512): that mode cannot drop a series, so each bundle's new names would stay on every scrape; a trained bundle's names
are the same each time. One process drops the old bundle's series and needs no limit."""


CUT_REASONS = ("receive_timeout", "peer_waiting", "no_request", "ended_unread", "streams", "answer_timeout", "peer_calls")


class ModelAgeCollector:
    """``shopping_agent_model_age_seconds``: now minus the oldest created-at among ``source``'s
    ``shopping_agent_model_created_timestamp_seconds`` samples, at scrape time; no series while none is set (no model:
    an age of NaN read as a number by the dashboard's fallback).

    ``source``: the process's own created-at gauge, or with ``--workers`` the pod's multiprocess collector, whose
    workers cannot carry an age computed at scrape time.
    """

    def __init__(self, source: Any) -> None:
        self._source = source

    def collect(self) -> Iterator[Any]:
        created = [s.value for f in self._source.collect() for s in f.samples
                   if s.name == "shopping_agent_model_created_timestamp_seconds" and math.isfinite(s.value) and s.value > 0]
        if created:
            family = GaugeMetricFamily("shopping_agent_model_age_seconds", "Seconds since the served bundle was created.")
            family.add_metric([], time.time() - min(created))
            yield family


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        # --- transport (go-grpc-prometheus names) --------------------------------------------
        self.grpc_started = Counter("grpc_server_started", "Total number of RPCs started on the server.",
                                    ["grpc_type", "grpc_service", "grpc_method"], registry=r)
        self.grpc_handled = Counter("grpc_server_handled",
                                    "Total number of RPCs completed on the server, regardless of success or failure.",
                                    ["grpc_type", "grpc_service", "grpc_method", "grpc_code"], registry=r)
        self.grpc_handling = Histogram("grpc_server_handling_seconds",
                                       "Histogram of response latency (seconds) of gRPC that had been application-level "
                                       "handled by the server.", ["grpc_type", "grpc_service", "grpc_method"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.calls_cut = Counter("shopping_agent_calls_cut",
                                 "Calls the server ended itself: receive_timeout (no request message in time), "
                                 "peer_waiting (too many of the address's calls waiting for theirs), no_request (the "
                                 "call ended without one), ended_unread (grpc ended it before its request was read: a "
                                 "message over the size limit, or the client reset it or let its deadline pass first), "
                                 "streams (past the streaming-call budget), answer_timeout "
                                 "(an answer could not be sent in time: every answer its connection held, closed with it), "
                                 "peer_calls (too many of the address's calls in progress).", ["reason"], registry=r)
        for reason in CUT_REASONS:
            self.calls_cut.labels(reason=reason)
        # --- decisions ---------------------------------------------------------------------
        self.decisions = Counter("shopping_agent_decisions", "Decisions served, by action and source.",
                                 ["action", "source"], registry=r)
        self.votes = Histogram("shopping_agent_decision_votes",
                               "Samples that voted for the served action, of decisions the sampled majority made (source policy).",
                               buckets=VOTE_BUCKETS, registry=r)
        self.vetoes = Counter("shopping_agent_guard_vetoes", "Actions vetoed by the Action Guard, by action.",
                              ["action"], registry=r)
        self.guardrail_hits = Counter("shopping_agent_guardrail_rule_hits",
                                      "Guardrail request rules that fired, by rule.", ["rule"], registry=r)
        self.degraded = Counter("shopping_agent_degraded_decisions",
                                "Decisions the rule engine answered because inference could not "
                                "(reason: overload, deadline, shutdown, error).", ["reason"], registry=r)
        self.inflight = Gauge("shopping_agent_inflight_requests", "RecommendAction calls in progress.",
                              registry=r, multiprocess_mode="livesum")
        # In-flight calls are counted in a plain int by the event loop's thread (the only
        # writer) and read at scrape time; multiprocess mode cannot read a function, so there
        # the gauge is incremented and decremented instead.
        self.inflight_count = 0
        self.inflight_tracked = multiprocess_mode()
        if not self.inflight_tracked:
            self.inflight.set_function(lambda: self.inflight_count)
        self.inference = Histogram("shopping_agent_inference_seconds",
                                   "Time to encode, infer and decide one micro-batch.", buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("shopping_agent_batch_size", "Requests per micro-batch.",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.queue_depth = Gauge("shopping_agent_inference_queue_depth",
                                 "Requests waiting for inference when the last batch was taken, its own included; "
                                 "0 once none waits.",
                                 registry=r, multiprocess_mode="livesum")
        # --- the model ---------------------------------------------------------------------
        self.model_info = Gauge("shopping_agent_model_info", "The model set being served (value 1).",
                                ["model_version", "format_version"], registry=r, multiprocess_mode="liveall")
        self.model_loaded = Gauge("shopping_agent_model_loaded", "1 when a model set is loaded, 0 when serving rules only.",
                                  registry=r, multiprocess_mode="livemin")
        self.model_load_time = Gauge("shopping_agent_model_load_timestamp_seconds",
                                     "When the served model set was loaded (Unix time).", registry=r, multiprocess_mode="livemin")
        self.model_created = Gauge("shopping_agent_model_created_timestamp_seconds",
                                   "The served bundle's created_at (Unix time); its age is time() minus this.",
                                   registry=r, multiprocess_mode="livemin")
        self.training = Gauge("shopping_agent_model_training_metric",
                              "Training metrics carried in the served bundle's manifest.", ["metric"], registry=r,
                              multiprocess_mode="liveall")
        self._training_names: set[str] = set()
        self.canary = Gauge("shopping_agent_canary_fraction",
                            "The share of sessions the canary bundle serves (no series: no canary).", ["model_version"],
                            registry=r, multiprocess_mode="liveall")
        self.swaps = Counter("shopping_agent_model_swaps", "Bundles the watcher judged, by result (ok, rejected) and reason.",
                             ["result", "reason"], registry=r)
        for result, reason in (("ok", ""), *(("rejected", r) for r in REASONS)):
            self.swaps.labels(result=result, reason=reason)  # series exist from the start: increase() sees the first one
        self.refused = Gauge("shopping_agent_weights_refused",
                             "1 while the file on the weights volume (file: active, canary) is one this server refused; "
                             "0 once it serves that file's bundle, or the file is gone.", ["file"], registry=r,
                             multiprocess_mode="livemax")
        for file in WATCHED_FILES:
            self.refused.labels(file=file).set(0)
        self.swap_seconds = Histogram("shopping_agent_model_swap_seconds",
                                      "Time to read, validate, self-test and warm up a bundle before the swap.",
                                      buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0), registry=r)
        self.last_swap = Gauge("shopping_agent_model_last_swap_timestamp_seconds", "When the last good bundle was swapped in.",
                               registry=r, multiprocess_mode="livemin")
        # --- decision and outcome logs ------------------------------------------------------
        self.outcomes = Counter("shopping_agent_outcomes_received", "ReportOutcome calls accepted, by outcome.",
                                ["outcome"], registry=r)
        self._outcomes = {o: self.outcomes.labels(outcome=o.key) for o in Outcome}
        self.engagements = Counter("shopping_agent_engagement_reports_received",
                                   "ReportEngagement calls accepted, by kind (bounced, stayed, unknown: no bounce signal).",
                                   ["kind"], registry=r)
        self._engagements = {kind: self.engagements.labels(kind=kind) for kind in ENGAGEMENT_KINDS}
        self.dwell = Histogram("shopping_agent_engagement_dwell_seconds", "Reported active dwell time on a page.",
                               buckets=DWELL_BUCKETS, registry=r)
        self.scroll = Histogram("shopping_agent_engagement_scroll_depth", "Reported scroll depth of a page (0 to 1).",
                                buckets=SCROLL_BUCKETS, registry=r)
        self.product_inference = Histogram("shopping_agent_product_inference_seconds",
                                           "Time to encode, score the three layers and decide one RecommendProduct "
                                           "micro-batch.", buckets=LATENCY_BUCKETS, registry=r)
        self.product_batch_size = Histogram("shopping_agent_product_batch_size", "RecommendProduct requests per micro-batch.",
                                            buckets=BATCH_BUCKETS, registry=r)
        self.product_queue_depth = Gauge("shopping_agent_product_inference_queue_depth",
                                         "RecommendProduct requests waiting for inference when the last batch was taken, "
                                         "its own included; 0 once none waits.", registry=r, multiprocess_mode="livesum")
        self.product_layers = Counter("shopping_agent_product_layer_decisions",
                                      "RecommendProduct layer choices served, by layer and source.", ["layer", "source"], registry=r)
        self._product_layers = {(layer, src): self.product_layers.labels(layer=layer.value, source=src.name.lower())
                                for layer in LAYERS for src in Source}
        self.product_vetoes = Counter("shopping_agent_product_guard_vetoes",
                                      "RecommendProduct candidates the guardrails permitted that the bundle's learned guard "
                                      "vetoed, by layer.", ["layer"], registry=r)
        self._product_vetoes = {layer: self.product_vetoes.labels(layer=layer.value) for layer in LAYERS}
        self.experience = ExperienceMetrics(r)
        if not multiprocess_mode():  # (with --workers the supervisor exports it from every worker's created-at)
            r.register(ModelAgeCollector(self.model_created))
            # process_resident_memory_bytes, process_cpu_seconds_total, process_open_fds, process_start_time_seconds …,
            # read from /proc at scrape time. With --workers, one process's would misstate the pod: the container's
            # own metrics (cAdvisor) say that there.
            ProcessCollector(registry=r)

        # Label children created once, so the request path only increments.
        self._decisions = {(a, s): self.decisions.labels(action=a.key, source=s.name.lower()) for a in Action for s in Source}
        self._vetoes = [self.vetoes.labels(action=a.key) for a in ACTIONS]
        self._degraded = {reason: self.degraded.labels(reason=reason) for reason in DEGRADED_REASONS}
        self._hits: dict[str, Any] = {}

    # --- request path ------------------------------------------------------------------------
    def decision_served(self, d: Decision) -> None:
        """Count one answered decision: its action and source, its votes, its vetoes, its guardrail hits."""
        self._decisions[(d.action, d.source)].inc()
        if d.source is Source.POLICY:  # (the others carry 0 votes)
            self.votes.observe(d.votes)
        if any(d.vetoed):
            for index, vetoed in enumerate(d.vetoed):
                if vetoed:
                    self._vetoes[index].inc()
        for rule in d.guardrail_hits:
            child = self._hits.get(rule)
            if child is None:
                child = self._hits[rule] = self.guardrail_hits.labels(rule=rule)
            child.inc()

    def product_served(self, decision: ProductDecision) -> None:
        """Count one answered RecommendProduct: each layer's choice by its source, and its guard's vetoes."""
        for layer, choice in decision.choices():
            self._product_layers[(layer, choice.source)].inc()
            if choice.vetoed:
                self._product_vetoes[layer].inc(choice.vetoed)

    def outcome_received(self, outcome: Outcome) -> None:
        self._outcomes[outcome].inc()

    def engagement_received(self, report: EngagementReport) -> None:
        kind = "unknown" if report.bounced is None else "bounced" if report.bounced else "stayed"
        self._engagements[kind].inc()
        if report.dwell_s is not None:
            self.dwell.observe(report.dwell_s)
        if report.scroll_depth is not None:
            self.scroll.observe(report.scroll_depth)

    def degraded_by(self, reason: str) -> None:
        self._degraded[reason].inc()

    def batch(self, decisions: list[Decision], seconds: float, queue_depth: int) -> None:
        """A micro-batch finished: its size, its time, the queue behind it (the servicer counts its decisions)."""
        self.batch_size.observe(len(decisions))
        self.inference.observe(seconds)
        self.queue_depth.set(queue_depth)

    def queue_empty(self) -> None:
        """The RecommendAction batcher's queue has emptied."""
        self.queue_depth.set(0)

    def product_queue_empty(self) -> None:
        self.product_queue_depth.set(0)

    def product_batch(self, decisions: list[ProductDecision], seconds: float, queue_depth: int) -> None:
        """A RecommendProduct micro-batch finished (the servicer counts its layers' choices)."""
        self.product_batch_size.observe(len(decisions))
        self.product_inference.observe(seconds)
        self.product_queue_depth.set(queue_depth)

    # --- model lifecycle ---------------------------------------------------------------------
    def swap_done(self, file: str, result: str, reason: str, seconds: float) -> None:
        """The watcher of ``file`` (``WATCHED_FILES``) judged the bundle there: swapped in (``ok``) or refused."""
        self.swaps.labels(result=result, reason=reason).inc()
        self.swap_seconds.observe(seconds)
        self.refused.labels(file=file).set(0 if result == "ok" else 1)
        if result == "ok":
            self.last_swap.set(time.time())

    def file_gone(self, file: str) -> None:
        """``file`` left the volume: nothing there is refused."""
        self.refused.labels(file=file).set(0)

    def model_served(self, version: str, manifest: Mapping[str, Any] | None, loaded_at: float) -> None:
        """The served model changed: info, timestamps and training metrics follow it."""
        self._forget(self.model_info)
        self._forget(self.training)
        if not multiprocess_mode():  # the series were dropped: only the new bundle's names are exported
            self._training_names.clear()
        if manifest is None:
            self.model_loaded.set(0)
            self.model_created.set(0)  # (no age exported)
            return
        self.model_info.labels(model_version=version, format_version=str(manifest.get("format_version", ""))).set(1)
        self.model_loaded.set(1)
        self.model_load_time.set(loaded_at)
        self.model_created.set(_timestamp(manifest.get("created_at")))
        metrics = manifest.get("training_metrics")
        if isinstance(metrics, Mapping):
            left_out = 0
            for name, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    key = str(name)
                    if key not in self._training_names and len(self._training_names) >= MAX_TRAINING_NAMES:
                        left_out += 1
                        continue
                    self._training_names.add(key)
                    self.training.labels(metric=key).set(float(value))
            if left_out:
                log.warning("training metrics not exported: this process has exported its limit of names",
                            extra={"fields": {"model_version": version, "left_out": left_out, "limit": MAX_TRAINING_NAMES}})


    def canary_served(self, version: str | None, fraction: float) -> None:
        """The canary changed: ``version`` serving ``fraction`` of the sessions, or none (``version`` None)."""
        self._forget(self.canary)
        if version is not None:
            self.canary.labels(model_version=version).set(fraction)

    @staticmethod
    def _forget(gauge: Gauge) -> None:
        """Drop the old model's series. Multiprocess mode cannot remove a series: zero it instead."""
        if multiprocess_mode():
            for labels in list(gauge._metrics):  # the label children created so far
                gauge.labels(*labels).set(0)
        else:
            gauge.clear()


class ExperienceMetrics:
    """The log writer's counters (``experience.recorder.RecorderObserver``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.records_written = Counter("shopping_agent_log_records_written", "Decision and outcome log records written, by kind.",
                                       ["kind"], registry=r)
        self.records_dropped = Counter("shopping_agent_log_records_dropped",
                                       "Log records lost, by kind and reason (queue_full, write_error, closed).",
                                       ["kind", "reason"], registry=r)
        self.queue_depth = Gauge("shopping_agent_log_queue_depth",
                                 "Log records waiting for the writer thread as its last flush ended, by kind (those held after a "
                                 "failed write included).",
                                 ["kind"], registry=r, multiprocess_mode="livesum")
        self.write_errors = Counter("shopping_agent_log_write_errors",
                                    "Attempts to write or finalise a log segment that failed (disk full, I/O error), by kind; "
                                    "retried with exponential back-off.", ["kind"], registry=r)
        self.writer_degraded = Gauge("shopping_agent_log_writer_degraded",
                                     "1 while the last attempt to write a kind's log segments failed (records are held and "
                                     "retried), else 0.", ["kind"], registry=r, multiprocess_mode="livemax")
        self._written = {k: self.records_written.labels(kind=k) for k in KINDS}
        self._dropped = {(k, why): self.records_dropped.labels(kind=k, reason=why) for k in KINDS for why in LOG_DROP_REASONS}
        self._depth = {k: self.queue_depth.labels(kind=k) for k in KINDS}
        self._errors = {k: self.write_errors.labels(kind=k) for k in KINDS}
        self._degraded = {k: self.writer_degraded.labels(kind=k) for k in KINDS}
        for gauge in self._degraded.values():
            gauge.set(0)

    def written(self, kind: str, n: int) -> None:
        self._written[kind].inc(n)

    def dropped(self, kind: str, reason: str, n: int) -> None:
        self._dropped[(kind, reason)].inc(n)

    def queued(self, kind: str, depth: int) -> None:
        self._depth[kind].set(depth)

    def write_failed(self, kind: str) -> None:
        self._errors[kind].inc()

    def degraded(self, kind: str, degraded: bool) -> None:
        self._degraded[kind].set(1 if degraded else 0)


def _timestamp(text: Any) -> float:
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return math.nan


def multiprocess_mode() -> bool:
    """Whether prometheus_client runs in multiprocess mode (it reads PROMETHEUS_MULTIPROC_DIR at import)."""
    from prometheus_client import values

    return bool(getattr(values.ValueClass, "_multiprocess", False))
