"""Qwen3-Omni's preprocessing (chat template, tokenizer, Whisper features, image patches).

transformers (5.19) cannot build `Qwen3OmniMoeProcessor` without a video processor, and its
video processors (and `AutoVideoProcessor`) need torchvision, which has no CPU wheel
reachable here. `load_processor` therefore returns `Qwen3OmniMoeProcessor.from_pretrained`
where torchvision is installed and otherwise `Qwen3OmniMoeProcessorNoVideo`: the same class
with its video processor left out. For text, images and audio both give identical outputs
(the subclass only drops the video argument); a request with video fails with a
`ValueError` instead of being silently ignored.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from transformers import Qwen3OmniMoeProcessor
from transformers.processing_utils import ProcessorMixin

VIDEO_UNSUPPORTED = (
    "video input needs torchvision, which is not installed (text, image and audio work)"
)


class _NoVideoProcessor:
    """What `Qwen3OmniMoeProcessor` reads of its video processor when there is no video."""

    model_input_names: list[str] = []

    def __init__(self, merge_size: int) -> None:
        self.merge_size = merge_size


class Qwen3OmniMoeProcessorNoVideo(Qwen3OmniMoeProcessor):
    """`Qwen3OmniMoeProcessor` without a video processor: image processor, Whisper feature
    extractor and tokenizer only, loaded from the same files (`from_pretrained(path)`)."""

    def __init__(
        self, image_processor=None, feature_extractor=None, tokenizer=None, chat_template=None
    ):
        # Skips Qwen3OmniMoeProcessor.__init__ (which needs a video processor); the attributes
        # it sets are set here the same way.
        ProcessorMixin.__init__(
            self, image_processor, feature_extractor, tokenizer, chat_template=chat_template
        )
        self.image_token = self.tokenizer.image_token
        self.audio_token = self.tokenizer.audio_token
        self.video_token = self.tokenizer.video_token
        self.image_token_id = self.tokenizer.image_token_id
        self.audio_token_id = self.tokenizer.audio_token_id
        self.video_token_id = self.tokenizer.video_token_id
        self.vision_bos_token = self.tokenizer.vision_bos_token
        self.vision_eos_token = self.tokenizer.vision_eos_token
        self.audio_bos_token = self.tokenizer.audio_bos_token
        self.audio_eos_token = self.tokenizer.audio_eos_token
        # The parent's token expansion reads `video_processor.merge_size` even without video.
        self.video_processor = _NoVideoProcessor(self.image_processor.merge_size)

    def __call__(self, text=None, images=None, videos=None, audio=None, **kwargs: Any):
        if videos is not None:
            raise ValueError(VIDEO_UNSUPPORTED)
        return super().__call__(text=text, images=images, audio=audio, **kwargs)

    @property
    def model_input_names(self) -> list[str]:
        names = (
            self.tokenizer.model_input_names
            + self.feature_extractor.model_input_names
            + self.image_processor.model_input_names
            + ["feature_attention_mask"]
        )
        return list(dict.fromkeys(names))

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """Saves as a `Qwen3OmniMoeProcessor` would (same files, `processor_class` naming the
        real processor so that `AutoProcessor` finds it), less the video processor's config."""
        if push_to_hub:
            raise ValueError("Qwen3OmniMoeProcessorNoVideo saves to a local directory only")
        files = super().save_pretrained(save_directory, **kwargs)
        for name in ("processor_config.json", "tokenizer_config.json"):
            path = Path(save_directory) / name
            if path.is_file():
                config = json.loads(path.read_text())
                if config.get("processor_class") == type(self).__name__:
                    config["processor_class"] = Qwen3OmniMoeProcessor.__name__
                    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        return files


def has_torchvision() -> bool:
    return importlib.util.find_spec("torchvision") is not None


def load_processor(model_path: str | Path) -> Qwen3OmniMoeProcessor:
    """The checkpoint's processor from a local directory (nothing is downloaded)."""
    cls = Qwen3OmniMoeProcessor if has_torchvision() else Qwen3OmniMoeProcessorNoVideo
    return cls.from_pretrained(str(model_path), local_files_only=True)
