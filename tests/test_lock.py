"""deploykit.lock: one writer per folder (an flock on <folder>/.deploykit.lock)."""
from __future__ import annotations

import fcntl
import os

import pytest

from deploykit.errors import StageError
from deploykit.lock import LOCK_NAME, lock_folders, release_all


@pytest.fixture(autouse=True)
def _release():
    yield
    release_all()


def _hold(folder, pid=4242, command="python 5_quantize.py int8"):
    """Another writer's lock: its own open file description, flocked, with its details."""
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, f"pid={pid}\nstarted=2026-01-01T00:00:00Z\ncommand={command}\n".encode())
    return fd


def test_second_writer_is_refused_naming_holder_and_fix(tmp_path):
    art, res = tmp_path / "a", tmp_path / "r"
    res.mkdir()
    fd = _hold(res, pid=999999999)
    try:
        with pytest.raises(StageError) as e:
            lock_folders(art, res, argv=["5_quantize.py", "int8"])
    finally:
        os.close(fd)
    msg = str(e.value)
    assert str(res) in msg and "pid 999999999" in msg and "2026-01-01T00:00:00Z" in msg
    assert "python 5_quantize.py int8" in msg  # the holder's recorded command (pid gone)
    assert "ARTIFACTS=/other/artifacts RESULTS=/other/results python 5_quantize.py int8" in msg
    # the artifacts lock taken before the refusal was given back: another writer can take it
    fd2 = os.open(art / LOCK_NAME, os.O_RDWR)
    fcntl.flock(fd2, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd2)


def test_holder_command_line_comes_from_proc(tmp_path):
    fd = _hold(tmp_path, pid=os.getpid(), command="stale")
    try:
        with pytest.raises(StageError) as e:
            lock_folders(tmp_path)
    finally:
        os.close(fd)
    assert f"pid {os.getpid()}" in str(e.value) and "stale" not in str(e.value)
    assert "pytest" in str(e.value)


def test_lock_is_taken_once_and_records_this_process(tmp_path):
    held = lock_folders(tmp_path)
    assert held == [tmp_path.resolve() / LOCK_NAME]
    assert lock_folders(tmp_path) == held  # a second call of the same process is no conflict
    text = (tmp_path / LOCK_NAME).read_text()
    assert f"pid={os.getpid()}\n" in text and "started=" in text
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR)
    with pytest.raises(BlockingIOError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)


def test_run_all_lock_does_not_block_its_stages(tmp_path):
    """run_all.sh holds $ARTIFACTS/.run_all.flock for its stages: another file."""
    fd = os.open(tmp_path / ".run_all.flock", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        assert lock_folders(tmp_path)
    finally:
        os.close(fd)


def test_symlinked_lock_file_is_refused_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / LOCK_NAME).symlink_to(target)
    with pytest.raises(StageError, match="symlink"):
        lock_folders(tmp_path)
    assert target.read_text() == "keep"


def test_a_folder_that_cannot_be_created_is_one_line_not_a_traceback(tmp_path):
    from deploykit.errors import StageError
    from deploykit.lock import lock_folders

    (tmp_path / "file").write_text("")
    with pytest.raises(StageError, match=r"cannot create .*file/sub .*point ARTIFACTS / RESULTS "
                                         "at a writable folder"):
        lock_folders(tmp_path / "file" / "sub")
