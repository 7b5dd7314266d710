"""What the conformance suite knows about the `ucx` relay backend."""

from tests.relay_conformance.backends import BackendSpec

UCX = BackendSpec("ucx", options={"peer_wait_s": 1.0})
