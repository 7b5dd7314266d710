"""The client SDK: `Client` and `AsyncClient` over the coordinator's gRPC API, plus helpers
that turn results into JSON, text and WAV files. Imports without torch."""

from omnirail.client.sdk import AbortResult, AsyncClient, Chunk, Client, GenerateResult

__all__ = ["AbortResult", "AsyncClient", "Chunk", "Client", "GenerateResult"]
