"""A save that fails (a full disk) leaves nothing behind and says which file and why."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import mounted_tmpfs
from unbroken.checkpoint.storage import StorageTier
from unbroken.errors import CheckpointError


@pytest.mark.timeout(60)
def test_a_save_onto_a_full_disk_removes_the_partial_step_and_names_file_and_cause(tmp_path):
    with mounted_tmpfs(tmp_path / "small", "2m") as small:
        tier = StorageTier(small / "ck")
        tier.save_rank(1, 0, 1, {"w": torch.zeros(1000)})
        tier.commit(1, 1)
        with pytest.raises(CheckpointError) as err:
            tier.save_rank(2, 0, 1, {"w": torch.zeros(1 << 20)})  # 4 MiB onto 2 MiB
        message = str(err.value)
        assert f"writing {small / 'ck' / 'step_00000002' / 'rank_00000.safetensors'}" in message, message
        assert "ENOSPC" in message and "disk is full" in message
        assert "?" not in message and "keep" not in message
        assert not (small / "ck" / "step_00000002").exists()
        assert tier.committed_steps() == [1]
        assert sorted(p.name for p in (small / "ck").iterdir()) == ["latest", "step_00000001"]
