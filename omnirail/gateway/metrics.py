"""The gateway's Prometheus metrics (served at its own `/metrics`); the mesh counts the
same requests again as native ones at the coordinator."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from omnirail.telemetry.metrics import LATENCY_BUCKETS

ROUTES = (
    "/v1/chat/completions",
    "/v1/audio/speech",
    "/v1/realtime",
    "/v1/models",
    "/health",
    "/metrics",
)
# Why a realtime connection was refused: at the handshake (no token, no Realtime API here)
# or told in an `error` event once accepted (another model, the session limit).
REFUSALS = ("unauthenticated", "not_served", "model_not_found", "session_limit_reached")


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._requests = Counter(
            "omnirail_gateway_requests_total",
            "HTTP requests the gateway answered, by route and status code.",
            ["route", "code"],
            registry=self.registry,
        )
        self._seconds = Histogram(
            "omnirail_gateway_response_start_seconds",
            "From an HTTP request's arrival to its response's status line (a streamed "
            "answer's first mesh event), by route.",
            ["route"],
            registry=self.registry,
            buckets=LATENCY_BUCKETS,
        )
        self._audio = Counter(
            "omnirail_gateway_audio_seconds_total",
            "Seconds of audio the gateway sent to clients.",
            registry=self.registry,
        )

        self._sessions = Gauge(
            "omnirail_gateway_realtime_sessions",
            "Realtime API sessions (WebSocket connections) open now.",
            registry=self.registry,
        )
        self._sessions_total = Counter(
            "omnirail_gateway_realtime_sessions_opened",
            "Realtime API sessions opened.",
            registry=self.registry,
        )
        self._refused = Counter(
            "omnirail_gateway_realtime_refused",
            "Realtime API connections refused, by reason: unauthenticated (no valid token), "
            "not_served (the pipeline declares no realtime API), model_not_found, "
            "session_limit_reached.",
            ["reason"],
            registry=self.registry,
        )
        for reason in REFUSALS:
            self._refused.labels(reason)

    # -- the realtime endpoint's observer (omnirail.gateway.realtime.endpoint.Observer) --

    def session_opened(self) -> None:
        self._sessions.inc()
        self._sessions_total.inc()

    def session_closed(self) -> None:
        self._sessions.dec()

    def session_refused(self, reason: str) -> None:
        self._refused.labels(reason if reason in REFUSALS else "other").inc()

    def request(self, path: str, code: int, seconds: float) -> None:
        # Unknown paths share one label: a scanner must not grow the label set.
        if path not in ROUTES:
            path = "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
        route = path
        self._requests.labels(route, str(code)).inc()
        self._seconds.labels(route).observe(seconds)

    def audio_seconds(self, seconds: float) -> None:
        if seconds > 0:
            self._audio.inc(seconds)
