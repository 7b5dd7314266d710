"""The wire format: generated protobuf types (`omnirail.v1`), the payload codec and typed
errors. Imports nothing else of omnirail."""
