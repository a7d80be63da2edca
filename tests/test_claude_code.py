"""Claude Code, unchanged, against a live ``prefixserve serve``: a plain turn, a turn that runs its
Bash tool and reads the result back, and two sessions with different first prompts that share the
system prompt and tool definitions in the prefix cache (with the attribution rule, not without).

Claude Code (``@anthropic-ai/claude-code``, pinned: on node 20 an unpinned install resolves to an
older release) is installed once by npm into ``.cache/claude-code`` (git-ignored); without npm the
tests skip. It runs with ``-p``, stdin closed, a temporary HOME and only 127.0.0.1 reachable.

The model is a random-weight llama (65k positions, for Claude Code's ~35k-token prompt) whose
output weights favour ``<|im_end|>``: free replies are a few tokens, then end the turn (a reply cut
at max_tokens is an error to Claude Code). The Bash turn comes from the server's testing aid
``--messages-force-tool-call``: the grammar allows exactly ``{"command": "echo hi"}``, and only
that command is allowed to run (``--allowedTools "Bash(echo hi)"``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from checkpoints import make_checkpoint
from safetensors.torch import load_file, save_file
from servers import server_process

from prefixserve.models.builtin import builtin_tokenizer

VERSION = "2.1.332"
ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "claude-code"
MODEL = "local"
ECHO_HI = {"name": "Bash", "input_schema": {
    "type": "object", "properties": {"command": {"const": "echo hi"}}, "required": ["command"],
    "additionalProperties": False}}  # fmt: skip


@pytest.fixture(scope="module")
def claude() -> Path:
    """The ``claude`` binary, installed by npm on first use."""
    binary = CACHE / "node_modules" / ".bin" / "claude"
    if not _works(binary):
        if shutil.which("npm") is None:
            pytest.skip("npm is not installed: cannot install Claude Code")
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(CACHE),
             f"@anthropic-ai/claude-code@{VERSION}"],
            check=True, capture_output=True, timeout=600,
        )  # fmt: skip
        if not _works(binary):  # npm did not run the post-install step that links the binary
            package = CACHE / "node_modules" / "@anthropic-ai" / "claude-code"
            subprocess.run(["node", "install.cjs"], cwd=package, check=True, timeout=300)
    assert _works(binary), f"Claude Code {VERSION} did not install into {CACHE}"
    return binary


def _works(binary: Path) -> bool:
    if not binary.exists():
        return False
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=60)  # fmt: skip
    return done.returncode == 0 and VERSION in done.stdout


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A random llama whose free replies end after a few tokens."""
    folder = make_checkpoint("llama", tmp_path_factory.mktemp("cc-model"), seed=1,
                             max_position_embeddings=65536)  # fmt: skip
    eos = builtin_tokenizer().convert_tokens_to_ids("<|im_end|>")
    weights = load_file(folder / "model.safetensors")
    weights["model.embed_tokens.weight"][:, 0] += 20.0  # a large constant in the residual ...
    weights["model.norm.weight"][0] = 1.0
    weights["lm_head.weight"][:, 0] = 0.0
    weights["lm_head.weight"][eos, 0] = 0.6  # ... that only the EOS logit reads
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def serve(model: Path, *extra: str):
    return server_process(
        "--model", str(model), "--served-model-name", MODEL, "--max-model-len", "65536",
        "--messages-force-tool-call", json.dumps(ECHO_HI), *extra,
        num_kv_blocks=12000, timeout=180,
    )  # fmt: skip


def session(claude: Path, base: str, prompt: str, *flags: str, tmp: Path) -> list[dict]:
    """One ``claude -p`` session; its stream-json messages (it must succeed)."""
    home, work = tmp / "home", tmp / "work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": "dummy", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_MAX_RETRIES": "0", "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256",
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
    }  # fmt: skip
    done = subprocess.run(
        [str(claude), "-p", "--model", MODEL, "--output-format", "stream-json", "--verbose",
         *flags, "--", prompt],
        env=env, cwd=work, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    messages = [json.loads(line) for line in done.stdout.splitlines()]
    result = messages[-1]
    assert result["type"] == "result" and result["subtype"] == "success"
    assert not result["is_error"], result
    return messages


def replies(messages: list[dict]) -> list[dict]:
    return [m["message"] for m in messages if m["type"] == "assistant"]


def prompt_tokens(usage: dict) -> int:
    return (usage["input_tokens"] + usage["cache_creation_input_tokens"]
            + usage["cache_read_input_tokens"])  # fmt: skip


def test_plain_turn_and_bash_turn(claude, model, tmp_path):
    with serve(model) as (_, base):
        plain = session(claude, base, "say hi", "--disallowedTools", "Bash", tmp=tmp_path)
        [reply] = replies(plain)
        assert [b["type"] for b in reply["content"]] == ["text"]
        assert plain[-1]["result"] == reply["content"][0]["text"]

        bash = session(claude, base, "run echo hi", "--allowedTools", "Bash(echo hi)",
                       tmp=tmp_path)  # fmt: skip
    call, answer = replies(bash)
    [use] = call["content"]
    assert use["type"] == "tool_use" and use["name"] == "Bash"
    assert use["input"] == {"command": "echo hi"}
    [result] = [b for m in bash if m["type"] == "user" for b in m["message"]["content"]]
    assert result["type"] == "tool_result" and result["tool_use_id"] == use["id"]
    assert result["content"] == "hi" and not result["is_error"]
    assert [b["type"] for b in answer["content"]] == ["text"]
    # the turn after the tool result reads the first prompt and the call from the cache
    first = prompt_tokens(call["usage"])
    assert answer["usage"]["cache_read_input_tokens"] >= first // 16 * 16


def test_sessions_share_the_system_prompt_and_tools(claude, model, tmp_path):
    """Claude Code sends its attribution line first; with the rule the second session (another
    first prompt) reads the system prompt and tools from the cache, without it almost nothing."""
    reads = {}
    for rule, extra in (("on", ()), ("off", ("--keep-attribution-header",))):
        with serve(model, *extra) as (_, base):
            flags = ("--disallowedTools", "Bash")
            session(claude, base, "say hi", *flags, tmp=tmp_path)
            second = replies(session(claude, base, "tell me a joke", *flags, tmp=tmp_path))[0]
        reads[rule] = (second["usage"]["cache_read_input_tokens"], prompt_tokens(second["usage"]))
    read_on, prompt = reads["on"]
    print(f"second session's first request: {reads['on'][0]} of {prompt} prompt tokens read "
          f"from the cache with the rule, {reads['off'][0]} without")  # fmt: skip
    assert read_on >= 0.75 * prompt  # everything before the first prompt: system and tools
    assert reads["off"][0] <= 64  # only the text before the attribution line's 3-hex suffix
