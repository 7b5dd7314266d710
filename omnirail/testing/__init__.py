"""What users and tests need to test pipelines without real checkpoints: tiny checkpoints
with random weights made on the spot (`omnirail.testing.tiny`). Nothing is downloaded."""
