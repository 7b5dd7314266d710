"""gRPC's I/O engine for omnirail's own processes, chosen before grpc is imported.

grpcio 1.85 routes sockets through its EventEngine by default: every message then crosses
an EventEngine thread, the completion queue and grpc.aio's poller thread before the event
loop sees it. On small hosts, whose idle vCPUs halt and wake slowly, those hops dominate a
mesh's latency. The older posix I/O path reads and writes in the polling thread. Measured
on a 2-vCPU VM: grpc.aio bidi round trip 240-300 µs with the EventEngine against 140-157
µs without; `omnirail bench pipeline --stages 3` p50 1.81-2.31 ms against 1.61-1.63 ms.

grpc reads GRPC_EXPERIMENTS once, when it loads, so this must run before anything imports
grpc; a value the user set (even an empty one) is left alone.
"""

from __future__ import annotations

import os
import sys

EXPERIMENTS_ENV = "GRPC_EXPERIMENTS"
POSIX_IO = "-event_engine_client,-event_engine_listener,-event_engine_for_all_other_endpoints"


def prefer_posix_io() -> bool:
    """Chooses the posix I/O path for this process and the processes it starts, unless
    GRPC_EXPERIMENTS is already set. True when it takes effect in this process."""
    os.environ.setdefault(EXPERIMENTS_ENV, POSIX_IO)
    return "grpc" not in sys.modules
