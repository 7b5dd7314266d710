"""What the conformance suite knows about the `nixl` relay backend."""

from tests.relay_conformance.backends import BackendSpec

NIXL = BackendSpec("nixl", options={"peer_wait_s": 1.0})
