"""`omnirail gateway`: the OpenAI-compatible HTTP front door of a mesh.

A separate process (Starlette on uvicorn) that is a client of the coordinator's native API
over one Session stream, so HTTP parsing, JSON and base64 work never run on the
coordinator's event loop, gateways scale and restart on their own, and every request is
admitted, traced and counted as a native one. Routes: `/v1/models`,
`/v1/chat/completions` (text and audio, SSE streaming), `/v1/audio/speech`, `/v1/realtime`
(the Realtime API over WebSocket: `realtime/` is the protocol, `realtime_mesh` its model on
the mesh), `/health`, `/metrics`. How requests map onto the pipeline is its `api.openai`
section.
"""
