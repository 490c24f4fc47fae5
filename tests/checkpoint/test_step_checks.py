"""Every file of a storage step is covered by a checksum, and tensor names are validated."""

from __future__ import annotations

import json
import zlib

import pytest
import torch

from tests.conftest import run_cli
from unbroken.checkpoint import tools
from unbroken.state.tree import flatten_state, unflatten_state
from unbroken.checkpoint.step_checks import MANIFEST_CRC_FIELD, manifest_crc
from unbroken.checkpoint.storage import StorageTier
from unbroken.errors import CheckpointCorrupt


def _save(root, step=10):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5)
    tier = StorageTier(root)
    tier.save_rank(step, 0, 1, {"tracked": {"model": model.state_dict(), "scheduler": sched.state_dict()}})
    tier.commit(step, 1)
    return tier, root / "step_00000010"


def _edit_json(path, edit):
    obj = json.loads(path.read_text())
    edit(obj)
    path.write_text(json.dumps(obj))


def _reseal(step_dir):
    """Make the manifest agree with an edited rank record (as a tool that knows the format could)."""
    def seal(m):
        m["ranks"][0]["record_crc32"] = zlib.crc32((step_dir / "rank_00000.json").read_bytes())
        m[MANIFEST_CRC_FIELD] = manifest_crc(m)
    _edit_json(step_dir / "MANIFEST.json", seal)


def test_an_edited_base_lrs_in_the_rank_record_fails_verify_and_load(tmp_path):
    tier, step_dir = _save(tmp_path)
    record = step_dir / "rank_00000.json"
    text = record.read_text()
    assert '"base_lrs"' in text and "0.1" in text
    record.write_text(text.replace("0.1", "0.5"))  # base_lrs [0.1] -> [0.5]
    problems = tools.verify(tmp_path)
    assert len(problems) == 1 and "rank_00000.json: crc32 mismatch" in problems[0]
    with pytest.raises(CheckpointCorrupt, match=r"rank_00000\.json: crc32 mismatch"):
        tier.load_rank(10, 0)
    assert tier.loadable_steps(0) == []
    cli = run_cli(["ckpt", "verify", str(tmp_path)], timeout_s=60)
    assert cli.returncode == 1 and "rank_00000.json" in cli.stdout, cli.stdout + cli.stderr


def test_an_edited_manifest_fails_verify(tmp_path):
    tier, step_dir = _save(tmp_path)
    _edit_json(step_dir / "MANIFEST.json", lambda m: m["meta"].update(note="edited"))
    problems = tools.verify(tmp_path)
    assert problems and "MANIFEST.json: crc32 mismatch" in problems[0]
    assert tier.committed_steps() == []


def test_a_tensor_name_with_dot_dot_is_rejected_at_verify_naming_the_record(tmp_path):
    tier, step_dir = _save(tmp_path)

    def rename(rec):
        node = rec["spec"]["root"]["items"][0][1]["items"][0][1]["items"][0][1]  # tracked/model/weight
        assert node["t"] == "tensor"
        node["k"] = "../../x"
    _edit_json(step_dir / "rank_00000.json", rename)
    _reseal(step_dir)
    problems = tools.verify(tmp_path)
    assert len(problems) == 1, problems
    assert "rank_00000.json: tensor name '../../x' is not allowed" in problems[0]


def test_a_spec_naming_a_tensor_the_file_lacks_fails_verify(tmp_path):
    tier, step_dir = _save(tmp_path)
    _edit_json(step_dir / "rank_00000.json",
               lambda rec: rec["spec"]["root"]["items"][0][1]["items"][0][1]["items"][0][1].update(k="other"))
    _reseal(step_dir)
    problems = tools.verify(tmp_path)
    assert len(problems) == 1 and "rank_00000.json: names tensor(s) ['other']" in problems[0], problems


def test_a_state_key_that_is_not_a_plain_name_still_round_trips():
    state = {"..": torch.ones(2), "a/../b": torch.zeros(1), "ok": torch.arange(3)}
    tensors, spec = flatten_state(state)
    assert "ok" in tensors and not any(".." in name.split("/") for name in tensors)
    back = unflatten_state(tensors, spec)
    assert all(torch.equal(back[k], v) for k, v in state.items())
