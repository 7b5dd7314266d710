"""The OpenAI Realtime API (GA events) for the gateway, free of the mesh.

- `events`: client frames validated into typed events (bad ones into `error` events) and
  builders of server events;
- `items`: conversation items and their JSON;
- `audio`: pcm16 <-> float32 and streaming resampling;
- `vad`: server VAD (`server_vad` semantics) on Silero VAD, the `realtime` extra;
- `session`: one session's state machine over a `Responder` (the model);
- `endpoint`: the Starlette WebSocket handler for `/v1/realtime`.
"""
