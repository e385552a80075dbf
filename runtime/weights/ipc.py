"""Weight buckets between two processes on the same GPU by CUDA (HIP) IPC handle, no copy on the wire.

A colocated engine shares its GPU with its trainer rank: the rank packs a bucket on the device,
hands over an IPC handle to the payload (a few hundred bytes through any channel: a pipe, Ray), and
the engine maps the same device memory, verifies the checksum and copies the values into its
weights; only then may the rank reuse or free the bucket (:class:`IpcSender` keeps it alive until
told). The pattern vLLM's and verl's colocated weight transfer uses; on ROCm the receiving process
must see the same devices as the sender (a narrower ``HIP_VISIBLE_DEVICES`` breaks the handles of
every GPU but the first), which the platform layer's visibility rules keep.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from rlkube.runtime.weights.bucket import BucketHeader, WeightBucket


@dataclass(frozen=True)
class IpcBucket:
    """A bucket's header and a handle to its device payload (picklable, tiny)."""

    header: BucketHeader
    handle: tuple[Any, tuple[Any, ...]]  # torch's (rebuild function, arguments)


def share_bucket(bucket: WeightBucket) -> IpcBucket:
    """An IPC handle to ``bucket``'s device payload; the caller keeps ``bucket`` alive until the
    receiver is done with it."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not bucket.payload.is_cuda:
        raise ValueError("IPC handles exist for GPU payloads only (the CPU path is the collective)")
    return IpcBucket(bucket.header(), reduce_tensor(bucket.payload))


def open_bucket(ipc: IpcBucket) -> WeightBucket:
    """The bucket as the receiver sees it: the sender's device memory, mapped (not copied)."""
    rebuild, args = ipc.handle
    return WeightBucket.from_header(ipc.header, rebuild(*args))


class IpcSender:
    """Shares a stream of buckets one at a time: each stays alive until :meth:`release` (after the
    receiver applied it), so the sender holds at most the bucket in flight plus the one being packed."""

    def __init__(self, buckets: Iterable[WeightBucket]) -> None:
        self._it: Iterator[WeightBucket] = iter(buckets)
        self._held: WeightBucket | None = None

    def next(self) -> IpcBucket | None:
        """The next bucket's handle, or None at the end of the stream."""
        self.release()
        try:
            self._held = next(self._it)
        except StopIteration:
            return None
        return share_bucket(self._held)

    def release(self) -> None:
        """The receiver is done with the bucket in flight (torch's IPC event already ordered its
        reads after the packing kernels)."""
        self._held = None
