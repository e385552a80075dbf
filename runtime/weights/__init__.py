"""Weight sync from trainer shards to rollout engines: full and delta_sharded, checksummed.

    sender = WeightSender(bucket_megabytes=256, dtype=torch.bfloat16)
    buckets = list(sender.delta(model.named_parameters(), version=step))   # trainer
    changed = apply_buckets(engine_state, buckets)                         # engine (atomic)
    sender.last_stats  # seconds, payload_mb, changed_ratio, buckets

In one process with the engine (``capabilities.direct_weights``), a full sync skips buckets:
``copy_direct(engine_params, model.named_parameters(), version)`` (a held ``DirectCopier`` reuses
its validated plan while both sides keep their tensors).

Transport: in-process (pass the buckets), `broadcast_buckets` / `gather_buckets` over
torch.distributed. See docs/weights.md.
"""

from rlkube.runtime.weights.apply import WeightReceiver, apply_buckets, verify_buckets
from rlkube.runtime.weights.bucket import (
    BucketEntry,
    BucketHeader,
    WeightBucket,
    WeightSyncError,
    payload_checksum,
    verify_checksum,
)
from rlkube.runtime.weights.direct import DirectCopier, DirectCopyStats, copy_direct, plan_direct_copy
from rlkube.runtime.weights.sender import LocalShard, SyncStats, WeightSender, is_sending_replica, local_shard
from rlkube.runtime.weights.transport import broadcast_buckets, gather_buckets

__all__ = [
    "BucketEntry",
    "BucketHeader",
    "DirectCopier",
    "DirectCopyStats",
    "LocalShard",
    "SyncStats",
    "WeightBucket",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncError",
    "apply_buckets",
    "broadcast_buckets",
    "copy_direct",
    "gather_buckets",
    "is_sending_replica",
    "local_shard",
    "payload_checksum",
    "plan_direct_copy",
    "verify_buckets",
    "verify_checksum",
]
