"""Process tuning for services and benchmarks: CPU pinning, idle-CPU wake latency, gRPC's
I/O path and the event loop."""
