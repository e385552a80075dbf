"""Importing an image into the node's containerd survives a garbage collection racing the unpack.

containerd will not lose a parent snapshot on demand, so a stand-in `ctr` (a script) plays that
fault: its first import fails with containerd's own message, the next one succeeds. A layout
problem that a retry cannot fix fails at once, naming the image.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from rlkube.devcluster.errors import DevClusterError
from rlkube.devcluster.images import import_layout

FAKE_CTR = r"""
import json, sys, tarfile
from pathlib import Path
state = Path(sys.argv[1])
args = sys.argv[2:]
log = json.loads(state.read_text()) if state.exists() else {"imports": [], "fail": []}
if args[:2] == ["images", "ls"]:
    print("REF TYPE DIGEST")
elif args[:2] == ["content", "ls"]:
    print("\n".join(log.get("held", [])))
elif args[:2] == ["images", "import"]:
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
        names = [m.name for m in tar]
    log["imports"].append(names)
    failure = log["fail"].pop(0) if log["fail"] else None
    state.write_text(json.dumps(log))
    if failure:
        print(failure)
        sys.exit(1)
    print("unpacking docker.io/rlkube/test:1 ...done")
    sys.exit(0)
state.write_text(json.dumps(log))
"""


def _layout(root: Path) -> tuple[Path, str]:
    """A one-blob OCI layout; returns it and the blob's digest."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    data = b"layer bytes"
    hexd = hashlib.sha256(data).hexdigest()
    (blobs / hexd).write_bytes(data)
    named = {"io.containerd.image.name": "docker.io/rlkube/test:1"}
    index = {"manifests": [{"digest": f"sha256:{hexd}", "annotations": named}]}
    (root / "index.json").write_text(json.dumps(index))
    (root / "oci-layout").write_text("{}")
    (root / "manifest-digest").write_text(f"sha256:{hexd}")
    return root, f"sha256:{hexd}"


def _ctr(tmp_path: Path, fail: list[str], held: list[str]) -> tuple[list[str], Path]:
    script = tmp_path / "ctr.py"
    script.write_text(FAKE_CTR)
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"imports": [], "fail": fail, "held": held}))
    return [sys.executable, str(script), str(state)], state


def test_an_unpack_that_lost_its_parent_snapshot_is_retried_with_every_blob(tmp_path: Path) -> None:
    layout, blob = _layout(tmp_path / "layout")
    lost = "failed to prepare extraction snapshot: parent snapshot sha256:cd692dfe does not exist: not found"
    ctr, state = _ctr(tmp_path, fail=[lost], held=[blob])

    assert import_layout(layout, ctr) is True

    imports = json.loads(state.read_text())["imports"]
    assert len(imports) == 2
    blob_name = f"blobs/sha256/{blob.split(':')[1]}"
    assert blob_name not in imports[0], "the first import skips blobs containerd already holds"
    assert blob_name in imports[1], "the retry streams every blob"


def test_an_import_that_cannot_succeed_fails_once_naming_the_image(tmp_path: Path) -> None:
    layout, _ = _layout(tmp_path / "layout")
    ctr, state = _ctr(tmp_path, fail=["ctr: unexpected EOF: invalid tar header"] * 3, held=[])

    with pytest.raises(DevClusterError, match=r"docker.io/rlkube/test:1 failed \(1 attempt"):
        import_layout(layout, ctr)
    assert len(json.loads(state.read_text())["imports"]) == 1


def test_a_retry_gives_up_after_its_attempts(tmp_path: Path) -> None:
    layout, _ = _layout(tmp_path / "layout")
    lost = "parent snapshot sha256:abc does not exist: not found"
    ctr, state = _ctr(tmp_path, fail=[lost] * 5, held=[])

    with pytest.raises(DevClusterError, match=r"3 attempt\(s\).*does not exist"):
        import_layout(layout, ctr, attempts=3)
    assert len(json.loads(state.read_text())["imports"]) == 3
