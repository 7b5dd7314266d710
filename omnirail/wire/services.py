"""Service names every side of the wire agrees on."""

from __future__ import annotations

from omnirail.v1 import client_pb2

# The client API. Its grpc.health.v1 status (on the coordinator) is SERVING once every stage
# has a live replica, as `PipelineInfo.ready` is.
PIPELINE_SERVICE = client_pb2.DESCRIPTOR.services_by_name["Omnirail"].full_name
