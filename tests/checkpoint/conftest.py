"""Fixtures shared by the checkpoint tests."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from unbroken.checkpoint.shm_files import remove_job

SHM = Path("/dev/shm")


@pytest.fixture
def job():
    """A unique job id in /dev/shm whose files are removed however the test ends."""
    job_id = f"t{uuid.uuid4().hex[:12]}"
    try:
        yield job_id
    finally:
        remove_job(SHM, job_id)
