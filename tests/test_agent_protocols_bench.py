"""``benchmarks/agent_protocols.py --quick`` end to end against a live server: every way runs,
and the Responses continuations recompute no more than re-sending the history does."""

from __future__ import annotations

import sys
from pathlib import Path

from servers import launch_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import agent_protocols


def test_agent_protocols_quick(tmp_path):
    with launch_server("--max-model-len", "4096") as base:
        result = agent_protocols.main(["--quick", "--base-url", base, "--out-dir", str(tmp_path)])
    rows = result["rows"]
    assert len(rows) == len(agent_protocols.WAYS) * 2 * 3  # ways x agents x turns
    # chain: 2 agents x 2 continued turns; WebSocket: the same plus each agent's warm-up
    assert result["continuations"] == {"token_exact": 10.0, "rerendered": 0.0, "truncated": 0.0}
    by = {(s["way"], s["turn"]): s for s in result["summary"]}
    for turn in (1, 2):
        for way in ("responses_chain", "responses_ws"):
            assert by[(way, turn)]["recomputed"] <= by[("chat", turn)]["recomputed"]
            assert by[(way, turn)]["bytes_sent"] < by[("responses_full", turn)]["bytes_sent"]
        assert by[("responses_chain", turn)]["cached_share"] > 0.5
    # a token-exact continuation recomputes its new tokens and the previous output's last token
    # (never fed to the model): every other token, the partial last block's too, is cached
    for row in rows:
        if row["way"] in ("responses_chain", "responses_ws") and row["turn"] > 0:
            assert row["recomputed"] == row["new"] + 1, row
    assert (tmp_path / "agent_protocols.json").exists()
