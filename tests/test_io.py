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


# ------------------------------------------------------------------------ planted links
def test_atomic_write_never_writes_through_a_link_at_a_temporary_name(tmp_path):
    """The temporary name used to be ``.tmp-<pid>-<name>`` (predictable): a link planted there
    made the writer overwrite what it pointed to. Now it is a fresh private folder."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    target = tmp_path / "row.json"
    for old in (f".tmp-{os.getpid()}-row.json", "row.json.tmp", ".tmp-row.json"):
        (tmp_path / old).symlink_to(victim)
    write_json(target, {"a": 1})
    assert victim.read_text() == "precious"
    assert json.loads(target.read_text()) == {"a": 1} and not target.is_symlink()
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # private folder removed


def test_atomic_write_replaces_a_link_at_the_final_name_not_its_target(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    target = tmp_path / "row.json"
    target.symlink_to(victim)
    write_json(target, {"a": 1})
    assert victim.read_text() == "precious" and not target.is_symlink()


def test_disk_full_names_the_free_space(tmp_path):
    target = tmp_path / "row.json"
    with pytest.raises(StageError, match=r"cannot write .*row\.json: the disk is full \[ENOSPC\]; "
                       r"nothing was written under that name: free some space \(\d+ MB free of "
                       r"[\d.]+ GB there; df -h "):
        with atomic_path(target):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
