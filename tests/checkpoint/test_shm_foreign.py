"""Files another user plants under the names of the memory tier are never followed or used."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

from unbroken.checkpoint import shm_files
from unbroken.checkpoint.memory import SnapshotWriter
from unbroken.checkpoint.memory_reader import SnapshotReader
from unbroken.errors import CheckpointError

NOBODY = 65534


def _as_nobody(*cmd: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    subprocess.run(cmd, user=NOBODY, group=NOBODY, check=True)


@pytest.fixture
def shared_dir():
    """A directory anyone may write to (like /dev/shm), and a root-only victim file."""
    root = Path(tempfile.mkdtemp(prefix="ub-foreign-"))  # pytest's tmp_path is 0700: nobody can't reach it
    try:
        os.chmod(root, 0o755)
        d = root / "shm"
        d.mkdir()
        os.chmod(d, 0o777)
        victim = root / "victim"
        victim.write_bytes(b"precious")
        os.chmod(victim, 0o600)
        yield d, victim
    finally:
        shutil.rmtree(root)


def test_a_planted_symlink_slot_is_replaced_and_its_target_untouched(shared_dir):
    d, victim = shared_dir
    job = f"t{uuid.uuid4().hex[:8]}"
    for name in (f"unbroken-{job}-r00000-s0", f"unbroken-{job}-r00000-s1", f"unbroken-{job}.owner",
                 f"unbroken-{job}-r00000.persisted", f"unbroken-{job}-r00000.persisted.tmp"):
        _as_nobody("ln", "-s", str(victim), str(d / name))
    shm_files.claim_job(d, job, os.getpid())
    writer = SnapshotWriter(d, job, 0)
    writer.write(3, {"w": torch.arange(10.0)})
    writer.write(4, {"w": torch.arange(10.0) + 1})
    writer.close()
    shm_files.mark_persisted(d, job, 0, 3)
    assert victim.read_bytes() == b"precious"
    for name in os.listdir(d):
        st = os.lstat(d / name)
        assert not os.path.islink(d / name) and st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o600, name
    state, _, _ = SnapshotReader(d, job, 0).read_flat()
    assert torch.equal(state["w"], torch.arange(10.0) + 1)
    shm_files.remove_job(d, job)


def test_a_reader_ignores_a_slot_of_another_user(shared_dir):
    d, _ = shared_dir
    job = f"t{uuid.uuid4().hex[:8]}"
    writer = SnapshotWriter(d, job, 0)
    writer.write(1, {"w": torch.zeros(4)})
    writer.close()
    forged = d / f"unbroken-{job}-r00000-s1"  # a copy by another user, claiming a newer step
    if os.geteuid() != 0:
        pytest.skip("needs root to make a file of another user")
    shutil.copy(d / f"unbroken-{job}-r00000-s0", forged)
    os.chown(forged, NOBODY, NOBODY)
    assert os.stat(forged).st_uid == NOBODY
    reader = SnapshotReader(d, job, 0)
    assert [step for step, _ in reader.committed()] == [1]
    assert [s["state"] for s in reader.slots()] == ["COMMITTED", "INVALID"]
    os.unlink(forged)
    shm_files.remove_job(d, job)


def test_a_foreign_file_that_cannot_be_removed_is_refused_clearly(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root may remove anything: the refusal needs a non-root writer")
    job = f"t{uuid.uuid4().hex[:8]}"
    d = tmp_path / "ro"
    d.mkdir()
    (d / f"unbroken-{job}-r00000-s0").symlink_to("/etc/hostname")
    os.chmod(d, 0o500)
    try:
        with pytest.raises(CheckpointError, match="not a file of this job.*symbolic link"):
            SnapshotWriter(d, job, 0).write(1, {"w": torch.zeros(4)})
    finally:
        os.chmod(d, 0o700)
