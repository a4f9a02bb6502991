"""deploykit.io: atomic writes (a failure or a full disk leaves nothing and names the path)."""

from __future__ import annotations

import errno
import json
import os

import pytest

from deploykit.errors import StageError
from deploykit.io import atomic_path, write_json


def test_atomic_path_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "x.json"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("interrupted")
    assert not target.exists() and list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------- writes
def test_disk_full_inside_atomic_write_names_the_path_and_keeps_the_old_file(tmp_path):
    target = tmp_path / "res" / "row.json"
    write_json(target, {"good": 1})
    with pytest.raises(StageError, match=r"cannot write .*row\.json: the disk is full "
                                                r"\[ENOSPC\]; the previous row\.json is unchanged"):
        with atomic_path(target) as tmp:
            tmp.write_text("partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert json.loads(target.read_text()) == {"good": 1}
    assert list(target.parent.iterdir()) == [target]  # no temporary left
