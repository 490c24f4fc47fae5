"""A local user who plants links under a job's shared-memory names cannot make it write elsewhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.integration.helpers import assert_same_weights, train

NOBODY = 65534


@pytest.mark.slow  # default run: the unit tests of tests/checkpoint/test_shm_foreign.py
@pytest.mark.timeout(240)
def test_symlinks_planted_by_another_user_are_replaced_and_the_job_trains_as_a_clean_run(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to plant links as another user")
    job = f"foreign{uuid.uuid4().hex[:8]}"
    victims = Path(tempfile.mkdtemp(prefix="ub-victim-"))
    try:
        victim = victims / "victim"
        victim.write_bytes(b"precious")
        names = [f"unbroken-{job}.owner"] + [
            f"unbroken-{job}-r{r:05d}{suffix}" for r in (0, 1)
            for suffix in ("-s0", "-s1", ".persisted", ".persisted.tmp")]
        for name in names:
            subprocess.run(["ln", "-s", str(victim), f"/dev/shm/{name}"], user=NOBODY, group=NOBODY, check=True)
        flags = ["--save", str(tmp_path / "ck"), "--ckpt-every-steps", "1", "--persist-every-steps", "2"]
        attacked, out, _ = train(tmp_path, "attacked", steps=6, nproc=2, flags=["--rdzv-id", job, *flags])
        assert attacked.returncode == 0, attacked.stdout[-3000:] + attacked.stderr[-3000:]
        assert victim.read_bytes() == b"precious"
        assert "not a file of this job (planted by another user?)" in attacked.stdout + attacked.stderr
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"unbroken-{job}")]
        clean, ref, _ = train(tmp_path, "clean", steps=6, nproc=2,
                              flags=["--save", str(tmp_path / "ck-clean"), "--ckpt-every-steps", "1",
                                     "--persist-every-steps", "2"])
        assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
        assert_same_weights(out, ref)
    finally:
        shutil.rmtree(victims)
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"unbroken-{job}"):
                os.unlink(f"/dev/shm/{name}")
