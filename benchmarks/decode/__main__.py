"""``python benchmarks/decode MODE [options]`` (see ``decode``)."""

import sys
from pathlib import Path

# Run as a directory, Python puts benchmarks/decode first on the path, where ``http`` and
# ``profile`` would shadow the standard library's: benchmarks/ takes its place.
sys.path[0] = str(Path(__file__).resolve().parent.parent)  # benchmarks/: peers, decode

from decode import main  # noqa: E402

main(sys.argv[1:])
