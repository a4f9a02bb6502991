"""deploykit.io: atomic writes (a failure or a full disk leaves nothing and names the path)."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

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


# ------------------------------------------------------------------------ the npz loader
import numpy as np  # noqa: E402

from deploykit.io import check_regular_file, load_npz  # noqa: E402


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("arrays, message", [
    ({"x": np.array([{"a": 1}, None], dtype=object)},
     r"--inputs .*bad\.npz: array 'x' is an object array \(pickled Python objects, not loaded: "
     r"allow_pickle=False\): save plain numeric arrays"),
    ({"x": np.array(["a", "b"])}, r"--inputs .*: array 'x' has dtype <U1 \(not numeric\)"),
    ({"x": np.zeros((0, 3), np.float32)}, r"array 'x' is empty \(shape \[0, 3\]\)"),
    ({"x": np.float32(1.0)}, r"array 'x' is a scalar: save samples with the batch on axis 0"),
    ({"x": np.zeros((4, 3), np.float32), "m": np.zeros((3, 3), np.float32)},
     r"arrays disagree on the number of samples \(axis 0; x: 4, m: 3\)"),
    ({"x": np.array([[0, 1], [np.nan, 2], [3, np.inf]], np.float32)},
     r"array 'x' holds NaN/Inf in 2 of 3 samples \(first: sample 1\)"),
])
def test_load_npz_refuses_inputs_that_are_not_numeric_samples(tmp_path, arrays, message):
    p = _npz(tmp_path / "bad.npz", **arrays)
    before = p.read_bytes()
    with pytest.raises(StageError, match=message):
        load_npz(p, None, "np.savez", flag="--inputs", feed=True)
    assert p.read_bytes() == before


def test_load_npz_names_wrong_keys_npy_files_and_huge_headers(tmp_path):
    p = _npz(tmp_path / "a.npz", y=np.zeros(2))
    with pytest.raises(StageError, match=r"--calib .*a\.npz lacks \['x'\] \(has \['y'\]\): rerun "):
        load_npz(p, ["x"], "4_make_calib.py", flag="--calib")
    np.save(tmp_path / "one.npy", np.zeros(2))
    with pytest.raises(StageError, match=r"one\.npy is a single \.npy array, not an \.npz"):
        load_npz(tmp_path / "one.npy", None, "np.savez")
    # bytes that are neither a zip nor .npy (numpy would unpickle them): named as such
    (tmp_path / "text.npz").write_bytes(b"not an archive, " * 8)
    with pytest.raises(StageError, match=r"text\.npz is not an \.npz file \(no zip archive, no "
                                         r"\.npy header"):
        load_npz(tmp_path / "text.npz", None, "np.savez")
    # an .npz whose member has a 200 kB header (numpy refuses > 10000 bytes unless told)
    import zipfile
    hdr = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), " + " " * 200_000 + "}\n"
    raw = b"\x93NUMPY\x02\x00" + len(hdr).to_bytes(4, "little") + hdr.encode() + b"\0" * 8
    with zipfile.ZipFile(tmp_path / "huge.npz", "w") as z:
        z.writestr("x.npy", raw)
    with pytest.raises(StageError, match=r"huge\.npz: array 'x' has an oversized \.npy header"):
        load_npz(tmp_path / "huge.npz", None, "np.savez")


@pytest.mark.parametrize("kind", ["fifo", "device", "folder"])
def test_a_fifo_device_or_folder_is_refused_before_it_is_opened(tmp_path, kind):
    path = {"fifo": tmp_path / "feed.npz", "device": Path("/dev/zero"), "folder": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)  # opening it would block until a writer appears
    want = {"fifo": "a FIFO (named pipe)", "device": "a character device",
            "folder": "a folder"}[kind]
    with pytest.raises(StageError, match=rf"--inputs {path} is {re.escape(want)}, not a "
                                         r"regular file: pass the file itself"):
        load_npz(path, None, "np.savez", flag="--inputs")
    with pytest.raises(StageError, match="not a regular file"):
        check_regular_file(path, "--labels-csv")


def test_a_fifo_as_onnx_or_labels_is_refused_never_opened(tmp_path):
    """require() (every artifact a stage reads: stage 3's and lint's --onnx) and --labels refuse
    a FIFO before opening it; opening would block the process until a writer appears."""
    import threading

    from deploykit.io import require
    from deploykit.data.user import load_labels
    from deploykit.onnx.graph import load_onnx

    fifo = tmp_path / "fp32.onnx"
    os.mkfifo(fifo)
    with pytest.raises(StageError, match=r"fp32\.onnx is a FIFO \(named pipe\), not a regular file"):
        require(fifo, "2_export_onnx.py")
    with pytest.raises(StageError, match=r"--labels .*labels\.npy is a FIFO \(named pipe\)"):
        os.mkfifo(tmp_path / "labels.npy")
        load_labels(tmp_path / "labels.npy", 4, "--labels")
    got = []

    def _load():  # a daemon thread: a regression blocks it, never the test process
        try:
            load_onnx(fifo)
        except StageError as e:
            got.append(str(e))

    t = threading.Thread(target=_load, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive() and got and "FIFO" in got[0]


# ------------------------------------------------------------------------ leftovers
def test_remove_leftovers_of_a_killed_run_keeps_live_and_new_ones(tmp_path):
    import subprocess
    import sys
    import time

    from deploykit.io import remove_leftovers

    old = time.time() - 3600
    made = {}
    for name in (".stage2-pid999999999-abc", ".tmp-5_quantize.pid999999999.x", ".tmp-fp32.onnx.q1",
                 f".tmp-{999999999}-calib.npz", ".write-probe-zz"):
        p = tmp_path / name
        if "onnx." in name or "stage2" in name or "5_quantize" in name:
            p.mkdir()
            (p / "int8_opset19.onnx").write_bytes(b"x")  # a ModelOpt intermediate
        else:
            p.write_bytes(b"x")
        made[name] = p
    # a live process (the holder) named one folder and holds a file open in another
    (tmp_path / ".tmp-row.json.held").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'w');"
                               " print('open', flush=True); time.sleep(60)",
                               str(tmp_path / ".tmp-row.json.held" / "row.json")],
                              stdout=subprocess.PIPE, text=True)
    keep = {"good": tmp_path / "fp32.onnx", "alive": tmp_path / f".stage2-pid{holder.pid}-x",
            "held": tmp_path / ".tmp-row.json.held", "new": tmp_path / ".tmp-new.json.n",
            "other": tmp_path / "tmp-not-ours"}
    for k, p in keep.items():
        if k == "alive":
            p.mkdir()
        elif k != "held":
            p.write_bytes(b"keep")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("x")
    (tmp_path / ".tmp-link").symlink_to(victim)
    for p in [*made.values(), *keep.values(), tmp_path / ".tmp-link"]:
        if p.name != ".tmp-new.json.n":
            os.utime(p, (old, old), follow_symlinks=False)
    try:
        assert holder.stdout.readline().strip() == "open"
        os.utime(keep["held"], (old, old))
        removed = remove_leftovers(tmp_path, time.time() - 60)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in removed) == sorted(made)
    assert not any(p.exists() for p in made.values())
    assert all(p.exists() for p in keep.values())
    assert (victim / "precious").read_text() == "x" and (tmp_path / ".tmp-link").is_symlink()
