"""`omnirail bench omni`: Qwen3-Omni on the mesh against transformers' own `generate()`.

Starts the installed Qwen3-Omni pipeline (`omnirail.models.qwen3_omni`; each stage its own
process, loading only its submodule) on `model_path`, or on a tiny random checkpoint made
here in a temporary folder when none is given (`omnirail.testing.tiny`; nothing is
downloaded), with the token
limits given. At each concurrency `c` the requests arrive in waves of `c` at once (the
next wave when the last one has ended), and for every request the client times its first
text chunk, its first audio chunk and its end; its audio is `code2wav.samples` at 24 kHz.
Per level: medians over requests (`ttft_ms`, `ttfa_ms`, `e2e_ms`, `rtf` = end-to-end
time / audio seconds of that request), and `requests_per_s` and `audio_s_per_s` (requests
and audio seconds over the waves' summed wall time). `cpu_s_per_request` is the CPU time
each mesh process (and `client`, this process) used during the mesh's waves, per request,
read from /proc (absent where there is none): on a host whose CPUs the mesh keeps busy,
throughput follows these seconds, and they say which stage to make cheaper.

With `baseline="transformers"` the same run loads `Qwen3OmniMoeForConditionalGeneration`
from the same directory into this process and times its `generate()` (greedy thinker and
talker, the same token limits, `return_audio=True`) on the same requests, one wave of the
mesh then one of transformers, in turn, so both sample the same minutes of a noisy host.
`generate()` does not stream: its first text and first audio are at its end. A wave of
`c` is one batch of `c` through `generate()` (see `_baseline_wave` for why not `c`
threads). Ratios per level: the mesh's first audio over transformers' end-to-end time,
the mesh's requests/s and audio-seconds/s over transformers', and its CPU seconds per
request over theirs (transformers': this process's CPU time during its waves).
"""

from __future__ import annotations

import importlib
import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from omnirail.bench import cpu_seconds

QWEN3_OMNI = "omnirail.models.qwen3_omni"
AUDIO_SAMPLE_RATE = 24_000  # code2wav's output: 1920 samples per 12.5 Hz code frame
KINDS = ("text", "image", "audio")
THINKERS = ("native", "vllm")
TEXT = "Describe this."
TINY = "tiny random (made here)"
BENCH = "bench-size random (made here): " + (
    "thinker text 8 layers x 512 (8 heads of 64, 16 experts, 4 per token), audio and vision "
    "encoders and talker and code2wav as the tiny one's"
)
BASELINE_BATCHING = (
    "a wave of c requests is one batch of c through generate() (left padding; "
    "transformers 5.19 batches thinker, talker and code2wav with audio output). c threads "
    "calling generate() on one shared model are not safe (the thinker and talker keep "
    "rope_deltas on the module between calls) and run one at a time under the GIL"
)


def _model(module: str) -> Any:
    """`omnirail.models.qwen3_omni.<module>` (the installed model; it needs the hf extra)."""
    return importlib.import_module(f"{QWEN3_OMNI}.{module}")


def _request(tiny_model: Any, kind: str, max_new_tokens: int) -> dict[str, Any]:
    """The mesh request for `tiny_model.sample_conversation(kind)` (the baseline's input)."""
    request: dict[str, Any] = {"text": TEXT, "max_new_tokens": max_new_tokens}
    if kind == "image":
        request["image"] = tiny_model.sample_image()
    if kind == "audio":
        request["audio"] = tiny_model.sample_audio()
        request["sample_rate"] = tiny_model.SAMPLE_RATE
    return request


def checkpoint(tmp: str, model_path: str | None, size: str, say: Callable[[str], None]) -> str:
    """`model_path` resolved, or (None) a random Qwen3-Omni checkpoint of `size` made in
    `tmp`."""
    if model_path is not None:
        return str(Path(model_path).resolve())
    from omnirail.testing.tiny import qwen3_omni as tiny_model

    say(f"making the {size} random Qwen3-Omni checkpoint")
    return str(tiny_model.make_tiny_model(Path(tmp) / size, size=size))


def write_pipeline(
    where: Path,
    model_path: str,
    max_new_tokens: int,
    talker_tokens: int,
    thinker_args: dict[str, Any] | None = None,
) -> Path:
    """Writes the installed Qwen3-Omni pipeline into `where` with `model_path`, the token
    limits and any thinker factory arguments set; its path."""
    import yaml

    from omnirail.models.registry import by_name

    where.mkdir(parents=True, exist_ok=True)
    cfg = yaml.safe_load(by_name("qwen3-omni").pipeline_file.read_text())
    cfg["model_path"] = model_path
    for stage in cfg["stages"]:
        args = stage.setdefault("factory_args", {})
        if stage["name"] == "preprocessing":
            args["max_new_tokens"] = max_new_tokens
        elif stage["name"] == "talker":
            args["max_new_tokens"] = talker_tokens
        elif stage["name"] == "thinker":
            args.update(thinker_args or {})
    path = where / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@contextmanager
def _pipeline(
    model_path: str,
    max_new_tokens: int,
    talker_tokens: int,
    thinker_args: dict[str, Any] | None = None,
) -> Iterator[Path]:
    """`write_pipeline` into a temporary folder, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="omnirail-bench-omni-") as tmp:
        yield write_pipeline(
            Path(tmp) / "qwen3_omni", model_path, max_new_tokens, talker_tokens, thinker_args
        )


def _thinker_args(thinker: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """The thinker stage's factory arguments for `thinker` (`native` or `vllm`)."""
    if thinker == "native":
        return {}
    # The tiny checkpoint is float32 (so are the other stages); eager: a short start-up.
    return {"engine": "vllm", "dtype": "float32", "enforce_eager": True, **(options or {})}


# ---- the mesh ---------------------------------------------------------------------------


def _mesh_one(client: Any, request: dict[str, Any]) -> dict[str, Any]:
    from omnirail.client.sdk import Chunk

    t0 = time.perf_counter()
    first: dict[str, float] = {}
    result = None
    for event in client.stream(request):
        if isinstance(event, Chunk):
            first.setdefault(event.modality, (time.perf_counter() - t0) * 1000)
        else:
            result = event
            break
    e2e_ms = (time.perf_counter() - t0) * 1000
    if result is None or "text" not in first or "audio" not in first:
        raise RuntimeError(f"the mesh's stream ended with chunks {sorted(first)} and no result")
    samples = int(result.outputs["code2wav"]["samples"])
    return {
        "ttft_ms": first["text"],
        "ttfa_ms": first["audio"],
        "e2e_ms": e2e_ms,
        "audio_s": samples / AUDIO_SAMPLE_RATE,
        "token_ids": list(result.outputs["decode"]["token_ids"]),
        "samples": samples,
    }


def _mesh_wave(client: Any, request: dict[str, Any], c: int) -> tuple[float, list[dict]]:
    """`c` requests at once, one thread each: (wall seconds, per-request samples)."""
    out: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            one = _mesh_one(client, request)
            out.append(one)
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(c)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return wall, out


class _CpuMeter:
    """CPU seconds per mesh process (and this one, `client`), summed over the spans it
    is told to `measure`."""

    def __init__(self, processes: dict[str, int]) -> None:
        self.processes = processes
        self.used: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        now = {"client": time.process_time()}
        for name, pid in self.processes.items():
            seconds = cpu_seconds(pid)
            if seconds is not None:
                now[name] = seconds
        return now

    @contextmanager
    def measure(self) -> Iterator[None]:
        before = self._now()
        yield
        after = self._now()
        for name, seconds in after.items():
            if name in before:
                self.used[name] = self.used.get(name, 0.0) + seconds - before[name]

    def per_request(self, requests: int) -> dict[str, float]:
        return {name: round(self.used[name] / requests, 4) for name in sorted(self.used)}

    def total_per_request(self, requests: int) -> float:
        return round(sum(self.used.values()) / requests, 4)


# ---- transformers' generate() -----------------------------------------------------------


class _Transformers:
    """`Qwen3OmniMoeForConditionalGeneration.generate` on the same directory, in this
    process (the example's `tiny_model.load_reference`: from_pretrained offline, float32,
    eval, with its transformers 5.19 workaround)."""

    def __init__(
        self, tiny_model: Any, model_path: str, kind: str, max_new_tokens: int, talker: int
    ) -> None:
        processor_mod = _model("processor")
        self.model = tiny_model.load_reference(model_path)
        self.processor = processor_mod.load_processor(model_path)
        # Rows of one batch are the same prompt here, but a batch for generate() is padded
        # on the left (decoder-only), whatever the tokenizer's default.
        self.processor.tokenizer.padding_side = "left"
        self.kwargs = tiny_model.generate_kwargs(
            self.model, thinker_max_new_tokens=max_new_tokens, talker_max_new_tokens=talker
        )
        self.conversation = tiny_model.sample_conversation(kind, TEXT)
        self._inputs: dict[int, dict[str, Any]] = {}
        # generate() ends with the vocoder over every row's codes; the codes of its last
        # call are kept (an instance attribute wraps the bound method; the module is
        # untouched) to time the vocoder alone on one request (`vocoder_floor_ms`).
        self.codes: Any = None
        decode = self.model.code2wav.chunked_decode

        def keep_codes(codes: Any, *args: Any, **kwargs: Any) -> Any:
            self.codes = codes
            return decode(codes, *args, **kwargs)

        self._decode = decode
        self.model.code2wav.chunked_decode = keep_codes

    def inputs(self, c: int) -> dict[str, Any]:
        """The processor's batch of `c` copies of the conversation (made once per size:
        preprocessing is outside the timed call, as the mesh's is inside it; it is the
        smallest part of a request)."""
        if c not in self._inputs:
            conv = self.conversation
            text = self.processor.apply_chat_template(
                conv, add_generation_prompt=True, tokenize=False
            )
            parts = [p for m in conv for p in m["content"] if isinstance(p, dict)]
            images = [p["image"] for p in parts if p.get("type") == "image"]
            audio = [p["audio"] for p in parts if p.get("type") == "audio"]
            self._inputs[c] = dict(
                self.processor(
                    text=[text] * c,
                    images=images * c or None,
                    audio=audio * c or None,
                    return_tensors="pt",
                    padding=True,
                )
            )
        return self._inputs[c]

    def wave(self, c: int) -> tuple[float, list[dict[str, Any]]]:
        """One batch of `c` through generate(): (wall seconds, per-request samples); every
        request of the batch ends, and first shows text and audio, when the call returns."""
        import torch

        inputs = self.inputs(c)
        prompt = inputs["input_ids"].shape[1]
        t0 = time.perf_counter()
        with torch.no_grad():
            sequences, wavs = self.model.generate(**inputs, **self.kwargs)
        wall = time.perf_counter() - t0
        if not isinstance(wavs, list):  # one sequence: a (1, 1, samples) tensor
            wavs = [wavs]
        out = []
        for row, wav in zip(sequences, wavs, strict=True):
            samples = int(wav.numel())
            out.append(
                {
                    "ttft_ms": wall * 1000,
                    "ttfa_ms": wall * 1000,
                    "e2e_ms": wall * 1000,
                    "audio_s": samples / AUDIO_SAMPLE_RATE,
                    "token_ids": row[prompt:].tolist(),
                    "samples": samples,
                }
            )
        return wall, out

    def vocoder_floor_ms(self, repeats: int = 3) -> float:
        """transformers' code2wav alone on one request's codes (the last wave's first
        row, as generate() decodes them), best of `repeats`: vocoder work that any
        server of this model does per request."""
        import torch

        one = self.codes[:1]
        best = math.inf
        with torch.no_grad():
            for _ in range(repeats):
                t0 = time.perf_counter()
                self._decode(one)
                best = min(best, time.perf_counter() - t0)
        return best * 1000


# ---- report -----------------------------------------------------------------------------


def _summary(walls: list[float], samples: list[dict[str, Any]]) -> dict[str, Any]:
    wall = sum(walls)
    audio = sum(s["audio_s"] for s in samples)
    out: dict[str, Any] = {"requests": len(samples), "waves": len(walls)}
    for key in ("ttft_ms", "ttfa_ms", "e2e_ms"):
        values = [s[key] for s in samples]
        out[key] = round(statistics.median(values), 2)
        out[f"{key}_runs"] = [round(v, 2) for v in values]
    out["audio_s"] = round(statistics.median(s["audio_s"] for s in samples), 4)
    out["rtf"] = round(statistics.median(s["e2e_ms"] / 1000 / s["audio_s"] for s in samples), 4)
    out["requests_per_s"] = round(len(samples) / wall, 4)
    out["audio_s_per_s"] = round(audio / wall, 4)
    out["wall_s"] = round(wall, 3)
    return out


def _ratios(mesh: dict[str, Any], base: dict[str, Any]) -> dict[str, float]:
    return {
        # Aim (issue 17): at most 0.25.
        "ttfa_over_transformers_e2e": round(mesh["ttfa_ms"] / base["e2e_ms"], 4),
        "ttft_over_transformers_e2e": round(mesh["ttft_ms"] / base["e2e_ms"], 4),
        "e2e_over_transformers_e2e": round(mesh["e2e_ms"] / base["e2e_ms"], 4),
        "requests_per_s": round(mesh["requests_per_s"] / base["requests_per_s"], 4),
        # Aim (issue 17): at least 3 at concurrency 8.
        "audio_s_per_s": round(mesh["audio_s_per_s"] / base["audio_s_per_s"], 4),
        "cpu_s_per_request": round(
            mesh["cpu_s_per_request_total"] / base["cpu_s_per_request_total"], 4
        ),
    }


def _ceiling(base: dict[str, Any], vocoder_ms: float, cores: int) -> float:
    """The most the mesh's audio-seconds/s could be over transformers' if the vocoder
    were its only work: the same code2wav on the same codes (streamed in chunks, it does at
    least the reference's convolutions) on every core at once, with thinker, talker, IO
    and the coordinator free. transformers' seconds per request over the vocoder's
    seconds per request per core."""
    per_request_ms = 1000 / base["requests_per_s"]
    return round(per_request_ms * cores / vocoder_ms, 3)


def _cpu_ceiling(mesh: dict[str, Any], base: dict[str, Any], cores: int) -> float:
    """The most the mesh's audio-seconds/s could be over transformers' at the CPU time per
    request it was measured to use, were every core busy with it all the time: `cores`
    over the mesh's CPU seconds per request, against transformers' requests per second.
    Past this, only a cheaper request helps, not more overlap."""
    return round(cores / mesh["cpu_s_per_request_total"] / base["requests_per_s"], 3)


def run_omni_bench(
    *,
    model_path: str | None = None,
    baseline: str | None = None,
    concurrency: Sequence[int] = (1, 8),
    requests: int = 16,
    max_new_tokens: int = 32,
    talker_max_new_tokens: int = 128,
    kind: str = "text",
    torch_threads: int = 1,
    thinkers: Sequence[str] = ("native",),
    thinker_options: dict[str, Any] | None = None,
    size: str = "tiny",
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """`requests` per concurrency level (rounded up to whole waves of `c`); one mesh per
    thinker engine in `thinkers` (`native`, `vllm`), all measured in the same run."""
    from omnirail.client.sdk import Client
    from omnirail.ops.launcher import Mesh

    say = progress or (lambda msg: None)
    if baseline not in (None, "transformers"):
        raise ValueError(f"baseline must be 'transformers' or none, not {baseline!r}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, not {kind!r}")
    levels = list(dict.fromkeys(concurrency))
    if not levels or min(levels) < 1 or requests < 1:
        raise ValueError("concurrency levels and requests must be at least 1")
    if max_new_tokens < 1 or talker_max_new_tokens < 1 or torch_threads < 1:
        raise ValueError("token limits and torch threads must be at least 1")
    thinkers = list(dict.fromkeys(thinkers))
    if not thinkers or any(t not in THINKERS for t in thinkers):
        raise ValueError(f"thinkers: some of {list(THINKERS)}, got {thinkers}")
    from omnirail.testing.tiny import qwen3_omni as tiny_model

    with tempfile.TemporaryDirectory(prefix="omnirail-qwen3-omni-") as tmp:
        path = checkpoint(tmp, model_path, size, say)
        base = None
        if baseline == "transformers":
            import torch

            # The mesh's stages run one compute thread each (torch_threads: 1); so does
            # the baseline unless told otherwise (on 2 busy vCPUs, 2 threads made the tiny
            # model's generate() slower and far noisier).
            torch.set_num_threads(torch_threads)
            say("loading transformers' Qwen3OmniMoeForConditionalGeneration")
            base = _Transformers(tiny_model, path, kind, max_new_tokens, talker_max_new_tokens)
        request = _request(tiny_model, kind, max_new_tokens)
        with ExitStack() as stack:
            meshes: dict[str, tuple[Any, dict[str, int]]] = {}
            for thinker in thinkers:
                pipeline = stack.enter_context(
                    _pipeline(
                        path,
                        max_new_tokens,
                        talker_max_new_tokens,
                        _thinker_args(thinker, thinker_options),
                    )
                )
                say(f"starting the mesh with the {thinker} thinker")
                mesh = Mesh(pipeline, progress=progress, env={"HF_HUB_OFFLINE": "1"})
                stack.callback(mesh.stop)
                mesh.start(timeout=600)
                assert mesh.address is not None
                client = stack.enter_context(Client(mesh.address, timeout=600, tensors="numpy"))
                meshes[thinker] = (client, mesh.processes())
            report_levels, check = _measure(meshes, request, base, levels, requests, say)
    report: dict[str, Any] = {
        "model": (TINY if size == "tiny" else BENCH) if model_path is None else path,
        "pipeline": f"{QWEN3_OMNI} (installed)",
        "kind": kind,
        "max_new_tokens": max_new_tokens,
        "talker_max_new_tokens": talker_max_new_tokens,
        "audio_sample_rate": AUDIO_SAMPLE_RATE,
        "concurrency": levels,
        "baseline": baseline,
        "thinkers": thinkers,
        "levels": report_levels,
    }
    if base is not None:
        report["baseline_batching"] = BASELINE_BATCHING
        report["baseline_torch_threads"] = torch_threads
        report["check"] = check
    return report


def _measure(
    meshes: dict[str, tuple[Any, dict[str, int]]],
    request: dict[str, Any],
    base: _Transformers | None,
    levels: list[int],
    requests: int,
    say: Callable[[str], None],
) -> tuple[list[dict[str, Any]], dict[str, bool]]:
    """Waves of each mesh (one per thinker) and of transformers in turn at each level. The
    first thinker's figures are `mesh` (and `ratios`); every thinker's are in `thinkers`."""
    # Warm-up, not timed: channels, pools and code paths of the mesh, one request and
    # one wave at the largest concurrency; the same for generate().
    say("warming up")
    solo = {}
    for name, (client, _) in meshes.items():
        solo[name] = _mesh_wave(client, request, 1)[1][0]
        _mesh_wave(client, request, max(levels))
    reference = None
    if base is not None:
        reference = base.wave(1)[1][0]
        base.wave(max(levels))
    first = next(iter(meshes))
    out: list[dict[str, Any]] = []
    equal = dict.fromkeys(meshes, True)
    batch_equal = True
    for c in levels:
        waves = math.ceil(requests / c)
        walls: dict[str, list[float]] = {name: [] for name in meshes}
        samples: dict[str, list[dict[str, Any]]] = {name: [] for name in meshes}
        cpus = {name: _CpuMeter(processes) for name, (_, processes) in meshes.items()}
        base_walls: list[float] = []
        base_samples: list[dict[str, Any]] = []
        base_cpu = _CpuMeter({})
        for w in range(waves):
            say(f"concurrency {c}: wave {w + 1} of {waves}")
            # Alternate which mesh goes first, so neither always follows transformers.
            order = list(meshes) if w % 2 == 0 else list(reversed(meshes))
            for name in order:
                with cpus[name].measure():
                    wall, got = _mesh_wave(meshes[name][0], request, c)
                walls[name].append(wall)
                samples[name].extend(got)
            if base is not None:
                with base_cpu.measure():
                    wall, got = base.wave(c)
                base_walls.append(wall)
                base_samples.extend(got)
        level: dict[str, Any] = {"concurrency": c, "thinkers": {}}
        for name in meshes:
            summary = _summary(walls[name], samples[name])
            n = len(samples[name])
            summary["cpu_s_per_request"] = cpus[name].per_request(n)
            summary["cpu_s_per_request_total"] = cpus[name].total_per_request(n)
            level["thinkers"][name] = summary
            # Greedy on every side: each request should give transformers' tokens and
            # audio length (the integration tests check codes and waveforms too).
            want = reference or solo[first]
            equal[name] &= all(_same(s, want) for s in samples[name])
        level["mesh"] = level["thinkers"][first]
        if base is not None:
            batch_equal &= all(_same(s, reference or solo[first]) for s in base_samples)
            level["transformers"] = _summary(base_walls, base_samples)
            cpu = base_cpu.total_per_request(len(base_samples))
            level["transformers"]["cpu_s_per_request_total"] = cpu
            vocoder_ms = base.vocoder_floor_ms()
            level["transformers"]["vocoder_ms_one_request"] = round(vocoder_ms, 2)
            cores = len(os.sched_getaffinity(0))
            for summary in level["thinkers"].values():
                ratios = _ratios(summary, level["transformers"])
                ratios["audio_s_per_s_ceiling"] = _ceiling(level["transformers"], vocoder_ms, cores)
                ratios["audio_s_per_s_cpu_ceiling"] = _cpu_ceiling(
                    summary, level["transformers"], cores
                )
                summary["ratios"] = ratios
            level["ratios"] = level["mesh"]["ratios"]
        out.append(level)
    check = {
        "mesh_equals_transformers": equal[first],
        "transformers_batch_equals_solo": batch_equal,
    }
    for name, same in equal.items():
        check[f"{name}_thinker_equals_{'transformers' if base is not None else 'solo'}"] = same
    return out, check


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["token_ids"] == b["token_ids"] and a["samples"] == b["samples"]
