"""Fixtures of the Qwen3-Omni tests: the tiny checkpoint (made here, never downloaded), the
reference model and the processor loaded from it, once per test module."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded

import pytest


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from omnirail.testing.tiny import qwen3_omni as tiny_model

    return tiny_model.make_tiny_model(tmp_path_factory.mktemp("qwen3_omni") / "tiny")


@pytest.fixture(scope="module")
def reference(tiny_dir):
    from omnirail.testing.tiny import qwen3_omni as tiny_model

    return tiny_model.load_reference(tiny_dir)


@pytest.fixture(scope="module")
def processor(tiny_dir):
    from omnirail.models.qwen3_omni.processor import load_processor

    return load_processor(tiny_dir)


@pytest.fixture(scope="module")
def streamer(reference):
    from omnirail.models.qwen3_omni.code2wav import Code2WavStreamer

    return Code2WavStreamer(reference.code2wav)
