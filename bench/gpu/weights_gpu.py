"""GPU weight-sync benchmark (H200 / MI300X): the same script as `make bench-weights`, on `cuda`.

    python bench/gpu/weights_gpu.py            # -> bench/results/weights-<gpu>.json and .png

One process, torch only (no Ray, no vLLM, rlkube need not be installed). Paths measured:
d2d with the snapshot on the device, d2d with a pinned host snapshot (the verl design), and
d2h2d (every bucket staged through pinned host memory), each against the measured D2D copy and
pinned H2D/D2H bandwidth of the same run.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from weights_bench import main

if __name__ == "__main__":
    raise SystemExit(main(["--device", "cuda", *sys.argv[1:]]))
