"""The read roofline of a one-stream float32 decode step on this machine, beside llama.cpp's step.

    python benchmarks/read_roofline.py [--rounds 3] [--passes 21] [--only NAME,...] [--no-peer]
        [--pages 2M 4k]

Builds ``read_roofline.cpp`` (g++ -O3 -march=native -fopenmp) into a temporary folder and runs
it with 2 OpenMP threads, on 2 MiB pages and on 4 KiB pages (``--pages``; a path maps that
file's first 538 MB from the page cache, as llama.cpp maps its GGUF): each variant reads SmolLM2-135M's
538 MB of float32 weights, in the shapes and order of a decode step's 121 matrices, one way (see
the C++ file's header); it prints ms per 538 MB (median and best of ``--passes``) and the best
GB/s. Each round then asks llama.cpp's native ``llama-server`` (2 threads, the F32 GGUF the
decode benchmark builds) for 128 greedy tokens three times and prints its own decode time per
token (``timings.predicted_per_token_ms``, the median), so that the two are read minutes apart
on the same host: this VM's memory speed moves with its neighbours.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent


def build(folder: Path) -> Path:
    binary = folder / "read_roofline"
    source = HERE / "read_roofline.cpp"
    cmd = ["g++", "-O3", "-march=native", "-fopenmp", "-o", str(binary), str(source)]
    subprocess.run(cmd, check=True)
    return binary


def roofline(binary: Path, pages: str, passes: int, only: str) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="2", OMP_PROC_BIND="true")
    out = subprocess.run(
        [str(binary), pages, str(passes), only], env=env, capture_output=True, text=True, check=True
    )
    return [json.loads(line) for line in out.stdout.splitlines()]


def llama_ms_per_token(tokens: int = 128, tries: int = 3) -> float:
    """llama-server's own decode ms per token on the F32 GGUF, 2 threads, the median of
    ``tries`` requests of ``tokens`` greedy tokens."""
    sys.path.insert(0, str(HERE))
    from peers import llama_server as peer

    model = peer.gguf_of_type(peer.smollm2_gguf(), "F32")
    port = peer.free_port()
    cmd = peer.llama_server_command(
        peer.require_binary("llama-server"), model, port, threads=2, parallel=1, ctx_per_slot=512
    )
    times = []
    with peer.running(cmd, port) as base:
        for _ in range(tries + 1):  # the first warms up
            body = {"prompt": "Once upon a time", "n_predict": tokens, "temperature": 0.0,
                    "ignore_eos": True}  # fmt: skip
            reply = httpx.post(f"{base}/completion", json=body, timeout=120).json()
            times.append(reply["timings"]["predicted_per_token_ms"])
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=21)
    parser.add_argument(
        "--only", default="", help="comma-separated: run the variants whose name contains one"
    )
    parser.add_argument("--no-peer", action="store_true", help="skip llama-server")
    parser.add_argument("--pages", nargs="+", default=["2M", "4k"])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        for r in range(args.rounds):
            for pages in args.pages:
                for row in roofline(binary, pages, args.passes, args.only):
                    print(f"round {r} {row['pages'][-4:]:4} {row['name']:22} median {row['median_ms']:6.2f} ms"
                          f"  best {row['best_ms']:6.2f} ms  {row['best_gbs']:5.1f} GB/s",
                          flush=True)  # fmt: skip
            if not args.no_peer:
                ms = llama_ms_per_token()
                print(f"round {r} llama-server F32 decode {ms:.2f} ms/token", flush=True)


if __name__ == "__main__":
    main()
