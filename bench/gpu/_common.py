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


class DecodeAttentionInputs:
    """One decode step's inputs to the rope-attention kernel, as a rollout's rows hold them.

    Rows come in groups of ``group`` samples of one prompt: each row's cache repeats its group
    leader's first ``min(own position, leader's position, prompt)`` positions (prefill wrote the
    prompt to each row), which a sharing kernel reads once per group. ``mixed``: positions uniform
    in [context/2, 3 context/2) (a long rollout's spread), else all at ``context``.
    """

    def __init__(
        self,
        rows: int,
        n_heads: int,
        n_kv: int,
        d: int,
        context: int,
        seq: int,
        dev: Any,
        mixed: bool,
        seed: int = 0,
        group: int = 8,
        prompt: int = 64,
    ) -> None:
        import torch

        dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
        g = torch.Generator().manual_seed(seed)
        if mixed:
            pos = torch.randint(context // 2, 3 * context // 2, (rows,), generator=g).clamp(max=seq - 1)
        else:
            pos = torch.full((rows,), context)
        idx = torch.arange(rows)
        lead = idx - idx % group
        shared = torch.where(lead == idx, 0, torch.minimum(pos, pos[lead]).clamp(max=prompt))
        self.qkv = torch.randn(rows, (n_heads + 2 * n_kv) * d, generator=g).to(dev, dtype)
        ang = torch.arange(seq)[:, None] * torch.rand(d // 2, generator=g)[None]
        self.cos = torch.cat([ang.cos(), ang.cos()], -1).to(dev, dtype)
        self.ssin = torch.cat([-ang.sin(), ang.sin()], -1).to(dev, dtype)
        gd = torch.Generator(device=dev).manual_seed(seed)  # caches drawn where they live: fast
        kc = torch.randn(rows, n_kv, seq, d, generator=gd, device=dev).to(dtype)
        vc = torch.randn(rows, n_kv, seq, d, generator=gd, device=dev).to(dtype)
        held = (torch.arange(seq)[None] < shared[:, None]).to(dev)[:, None, :, None]
        lead_d = lead.to(dev)
        self.k_cache = torch.where(held, kc[lead_d], kc)
        self.v_cache = torch.where(held, vc[lead_d], vc)
        self.pos, self.lead, self.shared = pos.to(dev), lead_d, shared.to(dev)
        el = self.k_cache.element_size()
        # what the kernel must read: every row's own K/V (the new token's included), each group's
        # shared prompt once; ``needed_bytes`` adds the q/k/v rows and the output
        self.kv_bytes = 2 * n_kv * d * el * int((pos + 1 - shared).sum())
        self.needed_bytes = self.kv_bytes + self.qkv.numel() * el + rows * n_heads * d * el
        self.host_pos = pos

    def cache_copies(self, total_bytes: int) -> list[tuple[Any, Any]]:
        """The caches and enough clones of them to span ``total_bytes`` (at least two; one on the
        CPU): timed round robin (:func:`cycling`), each call reads its caches from memory, not L2."""
        if self.k_cache.device.type == "cpu":
            return [(self.k_cache, self.v_cache)]
        one = 2 * self.k_cache.numel() * self.k_cache.element_size()
        n = max(2, -(-total_bytes // one))
        return [(self.k_cache, self.v_cache)] + [
            (self.k_cache.clone(), self.v_cache.clone()) for _ in range(n - 1)
        ]


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
