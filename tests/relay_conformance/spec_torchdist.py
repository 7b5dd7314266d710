"""What the conformance suite knows about the `torchdist` relay backend."""

from tests.relay_conformance.backends import BackendSpec

TORCHDIST = BackendSpec("torchdist", options={"peer_wait_s": 1.0})
