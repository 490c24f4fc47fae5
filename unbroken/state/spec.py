"""The state tree's spec format (:mod:`unbroken.state.tree` writes it) and the tensor names it
may use. No torch: a controller or a checker reads stored specs without it. Pure.
"""

from __future__ import annotations

import re
from typing import Any

SPEC_FORMAT = "unbroken-tree"
SPEC_VERSION = 1
ROOT_NAME = "_root"  # the tensor name of a tree that is one tensor, and the base of an unplain name

_MAX_NAME_CHARS = 4096
_BAD_NAME_RE = re.compile(r"[\x00-\x1f\x7f\\]")


def is_plain_name(name: Any) -> bool:
    """A tensor name we write: a non-empty str of "/"-joined parts, none empty, "." or "..",
    no control characters or backslashes."""
    return (isinstance(name, str) and 0 < len(name) <= _MAX_NAME_CHARS and not _BAD_NAME_RE.search(name)
            and all(part not in ("", ".", "..") for part in name.split("/")))
