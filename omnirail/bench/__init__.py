"""Benchmarks (`omnirail bench ...`)."""
