"""A short soak (about 20 s of load) through ``benchmarks/soak.py`` against a real server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_short_soak_holds_memory_fds_and_blocks(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--duration", "20",
           "--agents", "12", "--warmup", "6", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=85)
    report = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("soak PASS")
    assert report["requests_ok"] > 0 and report["requests_failed"] == 0
    assert report["kv_blocks_when_idle"]["used"] == 0
    assert all(report["checks"].values())
