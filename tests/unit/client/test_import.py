"""The client SDK imports without pulling in torch (a fresh interpreter, so nothing leaks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

PROBE = """
import json, sys
import omnirail, omnirail.client.sdk, omnirail.config, omnirail.wire.payload
client_cls = omnirail.Client
print(json.dumps({
    "client_is_sdk": client_cls is omnirail.client.sdk.Client,
    "torch_loaded": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
}))
"""


def test_client_sdk_imports_without_torch() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["client_is_sdk"]
    assert report["torch_loaded"] == [], "importing the client SDK imported torch"
