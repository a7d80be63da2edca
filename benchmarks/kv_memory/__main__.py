"""``python benchmarks/kv_memory MODE [options]`` (see ``kv_memory``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: workloads, kv_memory

from kv_memory import main

main(sys.argv[1:])
