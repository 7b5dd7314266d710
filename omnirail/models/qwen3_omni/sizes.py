"""How much weight memory each stage of the Qwen3-Omni pipeline needs, from a checkpoint's
safetensors headers alone (no tensor is read, nothing is loaded):

    python -m omnirail.models.qwen3_omni.sizes /models/Qwen3-Omni-30B-A3B-Instruct

prints one line per stage: the checkpoint prefixes it loads, its tensors and their bytes as
stored (bf16 in Qwen's release). Add activations and KV caches on top (they grow with the
requests a stage batches and their lengths).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

from .weights import INDEX_FILE, SUBMODULES, ModelDirError, weight_map

# Stage -> the submodule its process loads (`weights.load_submodule`; see stages.py).
STAGE_SUBMODULES = {
    "audio_encoder": "thinker.audio_tower",
    "image_encoder": "thinker.visual",
    "thinker": "thinker.text",
    "talker": "talker",
    "code2wav": "code2wav",
}


def stage_prefixes(stage: str) -> tuple[str, ...]:
    """The checkpoint prefixes `stage`'s process reads."""
    return SUBMODULES[STAGE_SUBMODULES[stage]].prefixes


def tensor_bytes(model_path: str | Path) -> dict[str, int]:
    """Every tensor's stored size in bytes, read from the safetensors headers."""
    path = Path(model_path)
    files = sorted(set(weight_map(path).values()))
    sizes: dict[str, int] = {}
    for name in files:
        file = path / name
        if not file.is_file():
            raise ModelDirError(f"{file}: no such file (a shard named by {INDEX_FILE})")
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for tensor, info in header.items():
            if tensor != "__metadata__":
                start, end = info["data_offsets"]
                sizes[tensor] = end - start
    return sizes


def stage_bytes(model_path: str | Path) -> dict[str, tuple[int, int]]:
    """Stage -> (tensors, bytes) of the weights its process loads."""
    sizes = tensor_bytes(model_path)
    out = {}
    for stage in STAGE_SUBMODULES:
        mine = [n for n in sizes if n.startswith(stage_prefixes(stage))]
        out[stage] = (len(mine), sum(sizes[n] for n in mine))
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m omnirail.models.qwen3_omni.sizes MODEL_DIR", file=sys.stderr)
        return 2
    try:
        stages = stage_bytes(args[0])
    except (ModelDirError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    total = sum(b for _, b in stages.values())
    for stage, (count, nbytes) in stages.items():
        prefixes = ", ".join(stage_prefixes(stage))
        print(f"{stage:14} {nbytes / 2**30:8.3f} GiB  {count:6d} tensors  ({prefixes})")
    print(f"{'all stages':14} {total / 2**30:8.3f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
