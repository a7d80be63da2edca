"""Every example runs against one `prefixserve serve` with the built-in model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from servers import launch_server

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def base_url():
    with launch_server("--tool-call-parser", "hermes") as base:
        yield f"{base}/v1"


def run_example(name: str, base_url: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--base-url", base_url, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_agent_loop_hits_the_cache(base_url):
    out = run_example("agent_loop.py", base_url, "--turns", "3", "--max-tokens", "4")
    cached = [int(m) for m in re.findall(r"cached (\d+)", out)]
    assert len(cached) == 3 and cached[1] > 0 and cached[2] >= cached[1]


def test_rag_reports_hit_rate(base_url):
    out = run_example("rag.py", base_url, "--questions", "3", "--max-tokens", "2")
    rate = float(re.search(r"hit rate: ([\d.]+)%", out).group(1))
    assert rate > 0


def test_parallel_sampling(base_url):
    out = run_example("parallel_sampling.py", base_url, "--n", "3", "--max-tokens", "4")
    assert len(re.findall(r"^sample \d", out, re.M)) == 3


def test_beam_search(base_url):
    out = run_example("beam_search.py", base_url, "--beam-width", "3", "--max-tokens", "4")
    assert len(re.findall(r"^beam \d", out, re.M)) == 3


def test_structured_agent_calls_every_turn_and_reports_json(base_url):
    out = run_example("structured_agent.py", base_url, "--turns", "3")
    cached = [int(m) for m in re.findall(r"cached (\d+)", out)]
    assert len(re.findall(r"called host_status\(host=", out)) == 3
    assert len(cached) == 4 and cached[1] > 0 and cached[2] > cached[1]
    assert "report: {" in out


def test_responses_agent_continues_from_the_cache(base_url):
    out = run_example("responses_agent.py", base_url, "--turns", "3")
    cached = [int(m) for m in re.findall(r"cached (\d+)", out)]
    prompts = [int(m) for m in re.findall(r"prompt (\d+) tokens", out)]
    assert len(re.findall(r"called host_status\(host=", out)) == 3
    assert len(cached) == 4 and all(c > 0 for c in cached[1:])
    # each continuation reuses all but the previous turn's partial block and new items
    assert all(p - c < 80 for p, c in zip(prompts[1:], cached[1:]))
    assert "report: {" in out
