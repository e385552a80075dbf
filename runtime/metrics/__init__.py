"""Per-step metrics: JSONL, TensorBoard, a terminal progress line, and the RLJob status pusher."""

from rlkube.runtime.metrics.sinks import JsonlSink, MetricsLogger, TensorBoardSink, TerminalSink, read_jsonl
from rlkube.runtime.metrics.status import StatusPusher, progress_from_metrics

__all__ = [
    "JsonlSink",
    "MetricsLogger",
    "StatusPusher",
    "TensorBoardSink",
    "TerminalSink",
    "progress_from_metrics",
    "read_jsonl",
]
