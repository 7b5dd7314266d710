"""Stream one request from a running omni demo: print the text as it decodes, save the audio.

    python -m examples.omni_demo.client --address localhost:50051 --text "Hello there" \
        --wav answer.wav [--image] [--audio]

`--image`/`--audio` send a small synthetic picture and tone (real numpy arrays; any
HxWx3 uint8 image or 16 kHz mono float/int16 recording works the same way).
"""

from __future__ import annotations

import argparse

import numpy as np

from omnirail import Chunk, Client
from omnirail.client.render import WavSink


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", default="localhost:50051")
    ap.add_argument("--text", default="Tell me about the sea.")
    ap.add_argument("--wav", default="answer.wav")
    ap.add_argument("--image", action="store_true")
    ap.add_argument("--audio", action="store_true")
    ap.add_argument("--timeout", type=float, default=120.0, help="request deadline, seconds")
    args = ap.parse_args()

    inputs: dict = {"text": args.text}
    if args.image:
        y, x = np.mgrid[0:96, 0:128]
        inputs["image"] = np.stack([x * 2, y * 2, (x + y)], axis=-1).astype(np.uint8)
    if args.audio:
        t = np.arange(16000) / 16000
        inputs["audio"] = (0.3 * np.sin(2 * np.pi * 330 * t)).astype(np.float32)

    # tensors="numpy": audio arrives as numpy arrays, and torch is never imported here.
    client = Client(args.address, timeout=args.timeout, tensors="numpy")
    with client, WavSink(args.wav) as wav:
        for event in client.stream(inputs):
            if isinstance(event, Chunk) and event.modality == "text":
                print(event.data, end="", flush=True)
            elif isinstance(event, Chunk) and event.modality == "audio":
                wav.write(event.data)
            elif not isinstance(event, Chunk):
                print(f"\n{wav.frames / (wav.rate or 1):.2f} s of audio in {args.wav}")
                print(event.outputs["decode"])


if __name__ == "__main__":
    main()
