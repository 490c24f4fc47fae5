"""What a worker tells the warm spares to import (worker/script_imports.py), the names each end
accepts (protocol spare_import_names) and the spare's import of them (agent/spare.py). Pure, no
process: fake module tables."""

from __future__ import annotations

import logging
import types

import pytest

from unbroken.agent.spare import pre_import
from unbroken.protocol.messages import MAX_SPARE_IMPORTS, spare_import_names
from unbroken.worker.script_imports import script_imports

pytestmark = pytest.mark.timeout(30)


def _module(name: str, file: str | None, package: bool = False) -> types.ModuleType:
    mod = types.ModuleType(name)
    if file is not None:
        mod.__file__ = file
    if package:
        mod.__path__ = [file.rsplit("/", 1)[0]] if file else []
    return mod


class _Lazy(types.ModuleType):
    """A module whose __getattr__ answers every name (as lazy-loading libraries do)."""

    def __getattr__(self, name: str) -> object:
        return ["/anywhere"]


def test_third_party_top_levels_and_their_packages_not_the_script_stdlib_private_or_deep_ones():
    modules = {
        "__main__": _module("__main__", "/job/train.py"),
        "json": _module("json", "/usr/lib/python3.11/json/__init__.py", package=True),
        "sys": _module("sys", None),
        "heavylib": _module("heavylib", "/site/heavylib/__init__.py", package=True),
        "heavylib.models": _module("heavylib.models", "/site/heavylib/models/__init__.py", package=True),
        "heavylib.models.bert": _module("heavylib.models.bert", "/site/heavylib/models/bert/__init__.py", True),
        "heavylib.models.bert.layers": _module("x", "/site/heavylib/models/bert/layers/__init__.py", True),
        "heavylib.utils": _module("heavylib.utils", "/site/heavylib/utils.py"),  # a module, not a package
        "heavylib._C": _module("heavylib._C", "/site/heavylib/_C.so"),
        "_cffi_backend": _module("_cffi_backend", "/site/_cffi_backend.so"),
        "helpers": _module("helpers", "/job/helpers.py"),  # the script's own folder
        "jobpkg": _module("jobpkg", "/job/jobpkg/__init__.py", package=True),
        "lazylib": _module("lazylib", "/site/lazylib/__init__.py"),
        "lazylib.sub": _Lazy("lazylib.sub"),  # not a package, whatever its __getattr__ says
    }
    names = script_imports(modules, script_dir="/job", path=["/site"])
    assert names == ["heavylib", "lazylib", "heavylib.models", "heavylib.models.bert"]
    # The script's folder also on the path (an installed checkout): its modules import by name anywhere.
    assert set(script_imports(modules, script_dir="/job", path=["/site", "/job"])) == {
        "heavylib", "lazylib", "heavylib.models", "heavylib.models.bert", "helpers", "jobpkg"}


def test_the_report_is_bounded_top_levels_first():
    modules = {f"lib{i:03d}.sub": _module(f"lib{i:03d}.sub", f"/site/lib{i:03d}/sub/__init__.py", True)
               for i in range(200)}
    modules.update({f"lib{i:03d}": _module(f"lib{i:03d}", f"/site/lib{i:03d}/__init__.py", True) for i in range(200)})
    names = script_imports(modules, script_dir=None)
    assert len(names) == MAX_SPARE_IMPORTS
    assert names[:200] == [f"lib{i:03d}" for i in range(200)] and names[200] == "lib000.sub"


def test_only_module_names_pass_at_each_end():
    names = spare_import_names(["numpy", "torch.distributed.fsdp", "numpy", "os; rm -rf /", "a b", "", "1abc",
                                "x" * 201, 7, None, "pkg..mod", "ok_name"])
    assert names == ["numpy", "torch.distributed.fsdp", "ok_name"]
    assert spare_import_names("numpy") == [] and spare_import_names({"numpy": 1}) == []
    assert len(spare_import_names([f"m{i}" for i in range(1000)])) == MAX_SPARE_IMPORTS


def test_a_spare_logs_an_import_that_fails_and_goes_on(caplog):
    with caplog.at_level(logging.WARNING, logger="unbroken.agent.spare"):
        failed = pre_import(["unbroken_t17a_no_such_module", "json", "colorsys"])
    assert failed == 1
    assert "could not pre-import unbroken_t17a_no_such_module: ModuleNotFoundError" in caplog.text
    import sys

    assert "colorsys" in sys.modules


def test_rank_0_of_a_launch_reports_once_unless_turned_off():
    from unbroken.worker.script_imports import report
    from unbroken.worker_config import WorkerConfig, WorkerSettings

    class Control:
        def __init__(self) -> None:
            self.sent: list = []

        def event(self, name, fields) -> None:
            self.sent.append((name, fields))

    sent = {}
    for label, cfg in {"rank 0": WorkerConfig(mode="managed"), "rank 1": WorkerConfig(mode="managed", rank=1),
                       "replacement": WorkerConfig(mode="managed", gen=1),
                       "off": WorkerConfig(mode="managed", worker=WorkerSettings(spare_preimport=False))}.items():
        control = Control()
        report(control, cfg)
        sent[label] = control.sent
    assert [name for name, _ in sent["rank 0"]] == ["script_imports"] and "torch" in sent["rank 0"][0][1]["modules"]
    assert sent["rank 1"] == sent["replacement"] == sent["off"] == []


def test_the_spare_warm_up_leaves_the_global_rng_where_it_was(caplog):
    import torch

    from unbroken.agent.spare import warm_up

    before = torch.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="unbroken.agent.spare"):
        warm_up()
    assert torch.equal(torch.get_rng_state(), before) and "warm-up failed" not in caplog.text
