"""Conversations on the Qwen3-Omni mesh: a turn's thinker reuses the KV cache its
conversation's previous turn left on the replica that served it (every hop routes a
conversation's turns there), so it computes only the new turn's tokens; after that replica
is killed, the next turn is rebuilt from its history on another one and is still right.

Real processes (two thinker replicas); "right" is what the same history answers from scratch
(a request without a conversation). The thinker's `omnirail_conversation_*` metrics, per
replica, say what each turn computed and reused.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("transformers")

from omnirail.bench.omni_bench import write_pipeline
from omnirail.client.sdk import Client
from omnirail.models.qwen3_omni.processor import load_processor
from omnirail.ops.launcher import Mesh
from omnirail.testing.tiny import qwen3_omni as tiny_model
from omnirail.wire.routing import conversation_index
from tests.integration.conftest import scrape, shm_names

pytestmark = pytest.mark.slow

THINKER_TOKENS = 10


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model.make_tiny_model(tmp_path_factory.mktemp("conversation") / "tiny")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Iterator[Mesh]:
    path = write_pipeline(tmp_path_factory.mktemp("pipeline"), str(tiny_dir), THINKER_TOKENS, 16)
    cfg = yaml.safe_load(path.read_text())
    for stage in cfg["stages"]:
        if stage["name"] == "thinker":
            stage["replicas"] = 2
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    running = Mesh(path, env={"HF_HUB_OFFLINE": "1"})
    running.start(timeout=300)
    yield running
    running.stop()
    assert shm_names(running.shm_prefix) == []


def _user(seed: int, text: str) -> dict[str, Any]:
    audio = tiny_model.sample_audio(seed, 0.5)
    return {
        "role": "user",
        "content": [
            {"type": "audio", "audio": audio, "sample_rate": tiny_model.SAMPLE_RATE},
            {"type": "text", "text": text},
        ],
    }


def _ask(client: Client, history: list[dict[str, Any]], conversation: str | None) -> list[int]:
    result = client.generate(
        {"messages": history, "speak": False}, conversation_id=conversation, timeout=120
    )
    return [int(t) for t in result.outputs["decode"]["token_ids"]]


def _figures(client: Client) -> dict[str, dict[str, float]]:
    """The thinker replicas' conversation counters, by replica address (names with their
    labels but the stage, as the exposition writes them)."""
    out = {}
    info = next(s for s in client.describe().stages if s.name == "thinker")
    for replica in info.replicas:
        values: dict[str, float] = {}
        for (name, pairs), value in scrape(replica.metrics_address).items():
            labels = dict(pairs)
            if not name.startswith("omnirail_conversation_") or labels.pop("stage") != "thinker":
                continue
            shown = ",".join(f'{k}="{v}"' for k, v in labels.items())
            values[f"{name}{{{shown}}}" if shown else name] = value
        out[replica.address] = values
    return out


def _moved(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict:
    """Per replica, the counters that changed between two readings."""
    return {
        address: {
            k: v - before.get(address, {}).get(k, 0.0)
            for k, v in values.items()
            if v != before.get(address, {}).get(k, 0.0) and not k.endswith("_created")
        }
        for address, values in after.items()
    }


def _tokens_of(processor: Any, history: list[dict[str, Any]], prompt: bool) -> int:
    """Tokens of `history` as the chat template renders it: as a prompt (the assistant's
    turn opened), or as what a finished turn leaves (its answer closed)."""
    text = processor.apply_chat_template(history, add_generation_prompt=prompt, tokenize=False)
    audio = [p["audio"] for m in history for p in m["content"] if p.get("type") == "audio"]
    return processor(text=text, audio=audio or None, return_tensors="pt")["input_ids"].shape[1]


def test_turns_reuse_the_kept_state_and_survive_its_replica(mesh: Mesh, tiny_dir: Path) -> None:
    processor = load_processor(tiny_dir)
    conversation = "conv-kept"
    with Client(mesh.address or "", timeout=120) as client:
        addresses = [
            r.address
            for r in next(s for s in client.describe().stages if s.name == "thinker").replicas
        ]
        owner = addresses[conversation_index(conversation, addresses)]
        history: list[dict[str, Any]] = []
        kept_length = 0  # tokens the kept turn covers: the history as the template renders it
        for turn in range(1, 4):
            history.append(_user(turn, f"Turn {turn}, please."))
            before = _figures(client)
            tokens = _ask(client, history, conversation)
            moved = _moved(before, _figures(client))
            # Right: what the same history answers from scratch.
            assert tokens == _ask(client, history, None)
            prompt = _tokens_of(processor, history, prompt=True)
            # Only the owner did the turn (the scratch request ran elsewhere or later).
            turns = moved[owner]
            if turn == 1:
                assert turns['omnirail_conversation_turns_total{state="rebuilt"}'] == 1
                assert turns["omnirail_conversation_prefill_tokens_total"] == prompt
            else:
                # The whole history came from the kept turn: only the new turn computed.
                assert turns['omnirail_conversation_turns_total{state="reused"}'] == 1
                assert turns["omnirail_conversation_reused_tokens_total"] == kept_length
                assert turns["omnirail_conversation_prefill_tokens_total"] == prompt - kept_length
            text = processor.tokenizer.decode(tokens, skip_special_tokens=True)
            history.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
            kept_length = _tokens_of(processor, history, prompt=False)

        # The replica that kept it dies; the next turn is rebuilt elsewhere, still right.
        pid = mesh.processes()[owner.rsplit("/", 1)[-1].removesuffix(".sock")]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while owner in [
            r.address
            for r in next(s for s in client.describe().stages if s.name == "thinker").replicas
        ]:
            assert time.monotonic() < deadline, "the coordinator kept the killed replica"
            time.sleep(0.2)
        history.append(_user(4, "Turn 4, please."))
        before = _figures(client)
        tokens = _ask(client, history, conversation)
        rebuilt = [m for m in _moved(before, _figures(client)).values() if m]
        assert tokens == _ask(client, history, None)
        assert any(
            m.get('omnirail_conversation_turns_total{state="rebuilt"}') == 1 for m in rebuilt
        ), rebuilt


def test_a_closed_conversation_is_rebuilt(mesh: Mesh) -> None:
    conversation = "conv-closed"
    with Client(mesh.address or "", timeout=120) as client:
        history = [_user(7, "Hello.")]
        first = _ask(client, history, conversation)
        history += [{"role": "assistant", "content": "fine"}, _user(8, "Again.")]
        client.close_conversation(conversation)
        time.sleep(0.5)  # the close reaches every replica on its Attach stream
        before = _figures(client)
        assert _ask(client, history, conversation) == _ask(client, history, None)
        moved = [m for m in _moved(before, _figures(client)).values() if m]
        assert any(
            m.get('omnirail_conversation_turns_total{state="rebuilt"}') == 1 for m in moved
        ), moved
        assert first
