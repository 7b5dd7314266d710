"""Loads one submodule of a Qwen3-Omni checkpoint, reading only that submodule's tensors.

A stage process holds its part of the model, not the whole 30B checkpoint:

    module = load_submodule(model_path, "thinker.audio_tower", torch.device("cuda:0"))

`model_path` is a local Hugging Face directory: config.json (`model_type: qwen3_omni_moe`)
plus `model.safetensors`, or `model.safetensors.index.json` and the shards it names. Only
the shards holding the submodule's tensors are opened (`safetensors.safe_open`), and only
the tensors under its prefix are read, one at a time, into a module built from the matching
sub-config directly on `device` (no random init, no full-model copy). The result is in eval
mode and equal, parameter for parameter, to the same submodule of
`Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_path)`.

The submodules (`SUBMODULES`): name, the checkpoint prefixes it reads, the module returned
and (in brackets) where the same module sits in `Qwen3OmniMoeForConditionalGeneration`:

- `thinker.audio_tower`: `thinker.audio_tower.`, the audio encoder (`thinker.audio_tower`)
- `thinker.visual`: `thinker.visual.`, the vision encoder (`thinker.visual`)
- `thinker.model`: `thinker.model.`, the MoE text model (`thinker.model`)
- `thinker.lm_head`: `thinker.lm_head.`, an `nn.Linear` (`thinker.lm_head`)
- `thinker.text`: `thinker.model.` and `thinker.lm_head.`, a `ThinkerText` holding both
  as `.model` and `.lm_head`
- `talker`: `talker.`, the talker with its code predictor (`talker`)
- `talker.code_predictor`: `talker.code_predictor.`, the code predictor alone
  (`talker.code_predictor`)
- `code2wav`: `code2wav.`, the codec vocoder (`code2wav`)

Checkpoints store MoE experts one by one (`...mlp.experts.3.gate_proj.weight`, as Qwen's
and as `save_pretrained` writes them); transformers' modules hold them fused
(`mlp.experts.gate_up_proj`: every expert's gate then up rows; `mlp.experts.down_proj`).
Each expert's tensors are copied into their slice of the fused ones; a checkpoint that
already stores them fused is read as is.

Every problem raises `ModelDirError` (a `ValueError`) with a one-line message naming the
file or tensor: no config.json, a config of another architecture, a shard that the index
names but is not there, a tensor the submodule needs that is in no shard, tensors under the
prefix that the submodule does not have, a shape that differs from the module's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

MODEL_TYPE = "qwen3_omni_moe"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_LISTED = 8  # names listed in one message before "... and N more"


class ModelDirError(ValueError):
    """A model directory that cannot be loaded; the message names the file or tensor."""


@dataclass(frozen=True)
class Submodule:
    """How one submodule is built and where its tensors are: `parts` pairs a prefix of the
    module's own state-dict keys with the checkpoint prefix those keys are stored under."""

    name: str
    parts: tuple[tuple[str, str], ...]
    reference: tuple[str, ...]  # attribute paths in Qwen3OmniMoeForConditionalGeneration

    @property
    def prefixes(self) -> tuple[str, ...]:
        return tuple(ckpt for _, ckpt in self.parts)


SUBMODULES: dict[str, Submodule] = {
    s.name: s
    for s in [
        Submodule("thinker.audio_tower", (("", "thinker.audio_tower."),), ("thinker.audio_tower",)),
        Submodule("thinker.visual", (("", "thinker.visual."),), ("thinker.visual",)),
        Submodule("thinker.model", (("", "thinker.model."),), ("thinker.model",)),
        Submodule("thinker.lm_head", (("", "thinker.lm_head."),), ("thinker.lm_head",)),
        Submodule(
            "thinker.text",
            (("model.", "thinker.model."), ("lm_head.", "thinker.lm_head.")),
            ("thinker.model", "thinker.lm_head"),
        ),
        Submodule("talker", (("", "talker."),), ("talker",)),
        Submodule(
            "talker.code_predictor", (("", "talker.code_predictor."),), ("talker.code_predictor",)
        ),
        Submodule("code2wav", (("", "code2wav."),), ("code2wav",)),
    ]
}


class ThinkerText(nn.Module):
    """The thinker without its encoders: `.model` (the MoE text model, checkpoint
    `thinker.model.`) and `.lm_head` (`thinker.lm_head.`), with the thinker's config."""

    def __init__(self, config: Any, model: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = lm_head


def read_config(model_path: str | Path) -> Any:
    """The checkpoint's `Qwen3OmniMoeConfig`, after checking that it is one."""
    from transformers import Qwen3OmniMoeConfig

    path = Path(model_path)
    if not path.is_dir():
        raise ModelDirError(f"model_path {str(path)!r} is not a directory")
    file = path / "config.json"
    if not file.is_file():
        raise ModelDirError(f"{file}: no such file (a model directory needs config.json)")
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelDirError(f"{file}: not readable JSON ({_one_line(e)})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type != MODEL_TYPE:
        raise ModelDirError(
            f"{file}: model_type is {model_type!r}, not {MODEL_TYPE!r} (another architecture)"
        )
    try:
        return Qwen3OmniMoeConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers' own validation of the config's fields
        raise ModelDirError(f"{file}: {_one_line(e)}") from None


def weight_map(model_path: str | Path) -> dict[str, str]:
    """Tensor name -> the file (relative to `model_path`) that holds it, from the index, or
    from the one `model.safetensors` (whose header alone is read)."""
    path = Path(model_path)
    index = path / INDEX_FILE
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelDirError(f"{index}: no weight_map ({_one_line(e)})") from None
        if not isinstance(mapping, dict):
            raise ModelDirError(f"{index}: weight_map is not an object")
        return {str(k): str(v) for k, v in mapping.items()}
    single = path / SINGLE_FILE
    if single.is_file():
        with _open(single) as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE)
    raise ModelDirError(f"{path}: neither {INDEX_FILE} nor {SINGLE_FILE} is there")


def load_submodule(
    model_path: str | Path,
    name: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> nn.Module:
    """Submodule `name` (a key of `SUBMODULES`) of the checkpoint at `model_path`, on `device`,
    in eval mode. `dtype`: the checkpoint config's dtype when None (float32 if it has none)."""
    if name not in SUBMODULES:
        raise ValueError(f"unknown submodule {name!r}; one of {', '.join(SUBMODULES)}")
    spec = SUBMODULES[name]
    path = Path(model_path)
    config = read_config(path)
    dtype = dtype or _config_dtype(config)
    device = torch.device(device)
    files = weight_map(path)
    plan = _plan(spec, files)
    module = build_submodule(config, name, device, dtype)
    _load(module, spec, plan, path)
    return module.eval()


def build_submodule(config: Any, name: str, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The (uninitialised) module for `name`, built from its sub-config on `device` as
    `from_pretrained` builds it: same classes, attention implementation and buffers."""
    from transformers import initialization as init
    from transformers.modeling_utils import local_torch_dtype
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as m

    thinker = config.thinker_config
    with ExitStack() as stack:
        stack.enter_context(init.no_init_weights())  # the checkpoint fills every parameter
        stack.enter_context(local_torch_dtype(dtype))
        stack.enter_context(torch.device(device))
        if name == "thinker.audio_tower":
            module = m.Qwen3OmniMoeAudioEncoder._from_config(thinker.audio_config, dtype=dtype)
        elif name == "thinker.visual":
            module = m.Qwen3OmniMoeVisionEncoder._from_config(thinker.vision_config, dtype=dtype)
        elif name == "thinker.model":
            module = m.Qwen3OmniMoeThinkerTextModel._from_config(thinker.text_config, dtype=dtype)
        elif name == "thinker.lm_head":
            module = _lm_head(thinker)
        elif name == "thinker.text":
            text = m.Qwen3OmniMoeThinkerTextModel._from_config(thinker.text_config, dtype=dtype)
            module = ThinkerText(thinker, text, _lm_head(thinker))
        elif name == "talker":
            module = m.Qwen3OmniMoeTalkerForConditionalGeneration._from_config(
                config.talker_config, dtype=dtype
            )
            # transformers 5.19: the talker's 3D rope reads `config.audio_config.n_window`
            # (audio and image in one request), which the talker's config lacks.
            if not hasattr(module.config, "audio_config"):
                module.config.audio_config = thinker.audio_config
        elif name == "talker.code_predictor":
            cls = m.Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration
            module = cls._from_config(config.talker_config.code_predictor_config, dtype=dtype)
        elif name == "code2wav":
            module = m.Qwen3OmniMoeCode2Wav._from_config(config.code2wav_config, dtype=dtype)
        else:
            raise ValueError(f"unknown submodule {name!r}; one of {', '.join(SUBMODULES)}")
    return module


def reference_parameters(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """The parameters of `name` in a full `Qwen3OmniMoeForConditionalGeneration`, keyed as
    `load_submodule(..., name)`'s own `named_parameters()` are (for tests and memory checks)."""
    spec = SUBMODULES[name]
    out: dict[str, torch.Tensor] = {}
    for (own, _), attr in zip(spec.parts, spec.reference, strict=True):
        sub = model.get_submodule(attr)
        for key, param in sub.named_parameters():
            out[own + key] = param
    return out


# --- what to read ------------------------------------------------------------------------

_FUSED = re.compile(r"^(?P<layer>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


@dataclass
class _Plan:
    """The checkpoint tensors under the submodule's prefixes and the files holding them."""

    names: dict[str, str]  # checkpoint tensor name -> file (relative)
    files: list[str]  # the files to open, in order


def _plan(spec: Submodule, files: dict[str, str]) -> _Plan:
    names = {k: v for k, v in files.items() if k.startswith(spec.prefixes)}
    if not names:
        raise ModelDirError(
            f"no tensor under {' or '.join(repr(p) for p in spec.prefixes)} in the checkpoint"
            f" ({spec.name} is not in it)"
        )
    return _Plan(names=names, files=sorted(set(names.values())))


def _load(module: nn.Module, spec: Submodule, plan: _Plan, path: Path) -> None:
    """Copies every tensor of `module`'s state dict from the checkpoint; refuses missing,
    extra and misshapen ones."""
    targets = module.state_dict(keep_vars=True)
    sources: dict[str, list[tuple[str, tuple[int, ...] | None]]] = {}
    missing: list[str] = []
    for key, target in targets.items():
        ckpt = _checkpoint_name(spec, key)
        fused = _FUSED.match(ckpt)
        if ckpt in plan.names or not fused:
            if ckpt not in plan.names:
                missing.append(ckpt)
            sources[key] = [(ckpt, None)]
            continue
        # Fused experts in the module, one tensor per expert in the checkpoint.
        layer, kind = fused["layer"], fused["kind"]
        parts = ["gate_proj", "up_proj"] if kind == "gate_up_proj" else ["down_proj"]
        names = [f"{layer}.{e}.{p}.weight" for e in range(target.shape[0]) for p in parts]
        missing += [n for n in names if n not in plan.names]
        sources[key] = [(n, None) for n in names]
    if missing:
        raise ModelDirError(
            f"{spec.name}: missing tensor{'s' if len(missing) > 1 else ''} {_names(missing)}"
            f" (in no file of {path})"
        )
    used = {n for srcs in sources.values() for n, _ in srcs}
    extra = sorted(set(plan.names) - used)
    if extra:
        raise ModelDirError(
            f"{spec.name}: unexpected tensor{'s' if len(extra) > 1 else ''} under"
            f" {' / '.join(spec.prefixes)}: {_names(extra)} (not in the module)"
        )
    for file in plan.files:
        if not (path / file).is_file():
            raise ModelDirError(f"{path / file}: no such file (a shard named by {INDEX_FILE})")
    with ExitStack() as stack:
        handles = {file: stack.enter_context(_open(path / file)) for file in plan.files}
        with torch.no_grad():
            for key, target in targets.items():
                srcs = [n for n, _ in sources[key]]
                if len(srcs) == 1 and _checkpoint_name(spec, key) == srcs[0]:
                    _copy(target, _read(handles, plan, path, srcs[0]), srcs[0], plan, path, key)
                else:
                    _copy_experts(target, srcs, handles, plan, path, key)


def _checkpoint_name(spec: Submodule, key: str) -> str:
    for own, ckpt in spec.parts:
        if key.startswith(own):
            return ckpt + key[len(own) :]
    raise AssertionError(f"{spec.name}: state-dict key {key!r} matches no part")  # by SUBMODULES


def _read(handles: dict[str, Any], plan: _Plan, path: Path, name: str) -> torch.Tensor:
    file = plan.names[name]
    try:
        return handles[file].get_tensor(name)
    except Exception as e:  # the index names a tensor that the shard lacks
        raise ModelDirError(f"{path / file}: cannot read tensor {name} ({_one_line(e)})") from None


def _copy(target, value, name, plan, path, key) -> None:
    if tuple(value.shape) != tuple(target.shape):
        raise ModelDirError(
            f"tensor {name} in {path / plan.names[name]} has shape {list(value.shape)},"
            f" the module's {key} needs {list(target.shape)}"
        )
    target.copy_(value)


def _copy_experts(target, names, handles, plan, path, key) -> None:
    """Fills a fused expert tensor [E, rows, cols] from per-expert weights: gate_up_proj from
    each expert's gate_proj then up_proj rows, down_proj from each expert's down_proj."""
    per_expert = len(names) // target.shape[0]
    rows = target.shape[1] // per_expert
    for i, name in enumerate(names):
        expert, part = divmod(i, per_expert)
        value = _read(handles, plan, path, name)
        expected = (rows, target.shape[2])
        if tuple(value.shape) != expected:
            raise ModelDirError(
                f"tensor {name} in {path / plan.names[name]} has shape {list(value.shape)},"
                f" the module's {key} needs {list(expected)} per expert"
            )
        target[expert, part * rows : (part + 1) * rows].copy_(value)


@contextmanager
def _open(file: Path) -> Iterator[Any]:
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:
        raise ModelDirError(f"{file}: not a readable safetensors file ({_one_line(e)})") from None
    with handle as f:
        yield f


def _lm_head(thinker_config: Any) -> nn.Linear:
    text = thinker_config.text_config
    return nn.Linear(text.hidden_size, text.vocab_size, bias=False)


def _config_dtype(config: Any) -> torch.dtype:
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    more = len(names) - _LISTED
    return shown + (f" ... and {more} more" if more > 0 else "")


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] + ("..." if len(text) > 300 else "")


def read_embed_table(model_path: str | Path) -> torch.Tensor:
    """The thinker's whole input embedding table (`thinker.model.embed_tokens.weight`), read
    from the checkpoint alone: `(vocab, D)`, in the checkpoint's dtype."""
    name = "thinker.model.embed_tokens.weight"
    files = weight_map(model_path)
    if name not in files:
        raise ModelDirError(f"{model_path}: no tensor {name!r}")
    with safe_open(str(Path(model_path) / files[name]), framework="pt") as f:
        return f.get_tensor(name)
