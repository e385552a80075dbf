"""What the GPU benchmarks share: importing rlkube from this checkout, the ceilings, the RL shape.

The GPU machine has torch but no rlkube install and no pydantic: ``import_rlkube`` makes
``rlkube`` a package rooted at this checkout (``rlkube.runtime`` -> ``runtime/``, ``rlkube.api`` ->
``api/``, ...), so only what a benchmark imports is loaded and ``rlkube.api`` (pydantic) never is.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

TOP = Path(__file__).resolve().parents[2]


def import_rlkube() -> None:
    """Use the installed package if there is one, else this checkout's folders, lazily."""
    try:
        import rlkube.runtime  # noqa: F401

        return
    except ImportError:
        pass
    for name in [m for m in sys.modules if m == "rlkube" or m.startswith("rlkube.")]:
        del sys.modules[name]
    pkg = types.ModuleType("rlkube")
    pkg.__path__ = [str(TOP)]  # rlkube.<folder> is the top-level folder of the same name
    sys.modules["rlkube"] = pkg


def draw_rl_lengths(
    prompts: int, samples: int, max_response: int, seed: int = 0, prompt_range: tuple[int, int] = (64, 320)
) -> tuple[list[int], list[int]]:
    """Prompt lengths (one per prompt, uniform in ``prompt_range``) and response lengths (one per
    sample): ``32 + (max_response - 32) * Beta(2, 1.6)``, a wide spread (mean ~0.56 of the maximum,
    a tail at the maximum) like GRPO rollouts on reasoning tasks, where responses end at their EOS.
    """
    import random

    rng = random.Random(seed)
    p_lens = [rng.randint(*prompt_range) for _ in range(prompts)]
    r_lens = [
        max(1, min(max_response, 32 + round((max_response - 32) * rng.betavariate(2.0, 1.6))))
        for _ in range(prompts * samples)
    ]
    return p_lens, r_lens


def spread(values: list[int]) -> dict[str, float]:
    s = sorted(values)
    return {
        "min": float(s[0]),
        "median": float(s[len(s) // 2]),
        "mean": sum(s) / len(s),
        "max": float(s[-1]),
    }


def ceilings(device: Any, smoke: bool) -> dict[str, Any]:
    from rlkube.runtime.models.roofline import measure_ceilings

    c = measure_ceilings(device, small=smoke)
    return {
        "read_bandwidth_gbs": c["read"]["read_GBps"],
        "copy_read_write_gbs": c["copy"]["read_write_GBps"],
        "gemm_tflops": c["gemm"]["TFLOPs"],
        "detail": c,
    }


def host_cpu() -> str:
    """The host's CPU model: a peer whose step is bound by Python's kernel launches (TRL's HF
    ``generate``) runs as fast as this CPU, so its figure belongs to the host, not only the GPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def run_info(device: Any, ceil: dict[str, Any], args: Any) -> dict[str, Any]:
    """What every GPU bench report starts with: the machine, the versions, the measured ceilings."""
    import torch
    import transformers

    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "host_cpu": host_cpu(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "read_bandwidth_gbs": ceil["read_bandwidth_gbs"],
        "gemm_tflops": ceil["gemm_tflops"],
        "copy_read_write_gbs": ceil["copy_read_write_gbs"],
        "ceilings": ceil["detail"],
        "args": vars(args),
    }


def sync(device: Any) -> None:
    """Wait for the GPU's queued work (timings end here); nothing to wait for on the CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cycling(calls: list[Any]) -> Any:
    """One callable running the next of ``calls`` each time (round robin): timed over copies of
    its inputs, a kernel reads each from memory, not from the cache the call before filled."""
    import itertools

    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def timed_calls(fn: Any, dev: Any, calls: int, repeats: int) -> list[float]:
    """Seconds per call of ``fn``, ``calls`` at a time; on CUDA replayed from a graph, as the decode
    step runs it (a Python launch costs more than the kernel at 64 rows)."""
    import time

    import torch

    def run() -> None:
        for _ in range(calls):
            fn()

    if dev.type == "cuda":
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
    times = []
    for _ in range(repeats):
        sync(dev)
        t = time.perf_counter()
        run()
        sync(dev)
        times.append((time.perf_counter() - t) / calls)
    return times
