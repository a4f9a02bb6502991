"""Stage 0 (0_prepare_data.py) run as a user runs it: unreadable images, subsets, every image
mode, file size limits, unwritable folders, usage errors, the tuning fraction."""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import numpy as np
import pytest

from deploykit.data.images import preprocess_image
from deploykit.layout import DEFAULT_DATA

from tests.helpers.stages import ROOT, run_stage
from tests.helpers.auto_models import _auto_env, _run
from tests.helpers.images import _class_folders, _env


SAMPLE = sorted(DEFAULT_DATA.glob("*.JPEG"))


@pytest.mark.slow
def test_stage0_tune_fraction_keeps_calibration_and_shrinks_eval(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for f in SAMPLE[:40]:
        (data / f.name).symlink_to(f)
    env = _auto_env(tmp_path, ALLOW_CLASS_SUBSET="1")
    base = ["0_prepare_data.py", "--model", "efficientnet_lite0", "--data-root", str(data)]
    p = _run(base, env)
    assert p.returncode == 0, p.stderr
    before = json.loads((tmp_path / "a" / "splits.json").read_text())
    p = _run(base + ["--tune-fraction", "0.25"], env)
    assert p.returncode == 0, p.stderr
    after = json.loads((tmp_path / "a" / "splits.json").read_text())
    assert after["calib"] == before["calib"] and len(after["tune"]) == 9
    assert sorted(after["eval"] + after["tune"]) == sorted(before["eval"])
    assert "9 tuning" in p.stdout
    summary = json.loads((tmp_path / "r" / "efficientnet_lite0" / "data.json").read_text())
    assert summary["n_tune"] == 9 and summary["n_eval"] == len(after["eval"])
    p = _run(base + ["--tune-fraction", "1.5"], env)
    assert p.returncode == 2 and "--tune-fraction 1.5: must be in [0, 1)" in p.stderr


DATA = DEFAULT_DATA


@pytest.mark.slow
def test_stage0_drops_unreadable_image_by_name(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for f in sorted(DATA.glob("*.JPEG")):
        (data / f.name).symlink_to(f)
    victim = sorted(data.glob("*.JPEG"))[5]
    victim.unlink()
    victim.write_bytes(b"\xff\xd8\xff this is not a jpeg")
    env = dict(os.environ, ARTIFACTS=str(tmp_path / "a"), RESULTS=str(tmp_path / "r"))
    p = run_stage(["0_prepare_data.py", "--data-root", str(data), "--model",
                   "efficientnet_lite0", "--calib-fraction", "0.05"], env)
    assert victim.name in p.stderr
    split = json.loads((tmp_path / "a" / "splits.json").read_text())
    assert [u["file"] for u in split["unreadable"]] == [victim.name]
    assert len(split["eval"]) + len(split["calib"]) == 999


@pytest.mark.slow
def test_stage0_usage_error_exits_2(tmp_path):
    env = dict(os.environ, ARTIFACTS=str(tmp_path))
    p = run_stage(["0_prepare_data.py", "--calib-fraction", "1.5"], env, check=False)
    assert p.returncode == 2 and "calib-fraction" in p.stderr


@pytest.mark.slow
def test_stage0_subset_flag_and_env(tmp_path):
    data = _class_folders(tmp_path / "d", SAMPLE[:6])
    args = ["0_prepare_data.py", "--data-root", str(data), "--model", "efficientnet_lite0"]
    p = run_stage(args, _env(tmp_path), check=False)
    assert p.returncode == 1 and "--allow-class-subset" in p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "a" / "splits.json").exists()
    run_stage(args, _env(tmp_path, ALLOW_CLASS_SUBSET="1"))
    split = json.loads((tmp_path / "a" / "splits.json").read_text())
    assert split["n_classes"] == 6 and split["class_subset"] is True
    assert sorted(c for _, c in split["eval"] + split["calib"]) == list(range(6))


@pytest.mark.slow
def test_stage0_loads_every_mode_from_a_mixed_folder(tmp_path):
    """Class folders with a 16-bit PNG, an RGBA PNG and a CMYK TIFF next to real JPEGs: stage 0
    reads all, and the 16-bit image is not white in the cache."""
    from PIL import Image

    data = _class_folders(tmp_path / "d", SAMPLE[:4])
    src = np.asarray(Image.open(SAMPLE[4]).convert("L"), np.uint16) * 257
    (data / SAMPLE[4].name[:9]).mkdir()
    Image.fromarray(src).save(data / SAMPLE[4].name[:9] / "g16.png")
    (data / SAMPLE[5].name[:9]).mkdir()
    Image.open(SAMPLE[5]).convert("RGBA").save(data / SAMPLE[5].name[:9] / "rgba.png")
    (data / SAMPLE[6].name[:9]).mkdir()
    Image.open(SAMPLE[6]).convert("CMYK").save(data / SAMPLE[6].name[:9] / "cmyk.tif")
    env = _env(tmp_path, ALLOW_CLASS_SUBSET="1")
    run_stage(["0_prepare_data.py", "--data-root", str(data), "--model", "efficientnet_lite0",
               "--calib-fraction", "0"], env)
    split = json.loads((tmp_path / "a" / "splits.json").read_text())
    assert len(split["eval"]) == 7 and not split["unreadable"]
    z = np.load(next((tmp_path / "a" / "cache").glob("eval-*.npz")))
    i16 = [str(f) for f in z["files"]].index(f"{SAMPLE[4].name[:9]}/g16.png")
    ref = preprocess_image(Image.open(SAMPLE[4]).convert("L").convert("RGB"), 256, 224,
                                  "bicubic")
    assert np.abs(z["x"][i16].astype(int) - ref).max() <= 1


@pytest.mark.slow
def test_stage0_file_size_limit_names_the_cache_and_keeps_the_previous_split(tiny_stage0,
                                                                            tmp_path):
    """A real failed write (RLIMIT_FSIZE gives EFBIG, as a full disk gives ENOSPC): the new
    cache cannot be written; the message names it and the previous split stays usable."""
    before = (tmp_path / "a" / "splits.json").read_text()
    data = tmp_path / "d"
    (data / SAMPLE[7].name[:9]).mkdir()
    (data / SAMPLE[7].name[:9] / "x.JPEG").symlink_to(SAMPLE[7])  # a new file list

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    import subprocess
    import sys

    p = subprocess.run([sys.executable, "0_prepare_data.py", "--data-root", str(data), "--model",
                        "efficientnet_lite0", "--calib-fraction", "0.34"], cwd=ROOT,
                       env=tiny_stage0, capture_output=True, text=True, preexec_fn=limit,
                       timeout=600)
    assert p.returncode == 1, p.stderr
    assert "cannot write" in p.stderr and ".npz: the file size limit is exceeded" in p.stderr
    assert "Traceback" not in p.stderr
    assert (tmp_path / "a" / "splits.json").read_text() == before
    assert not list((tmp_path / "a").rglob(".tmp-*"))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["file", "sys"])
def test_unwritable_results_folder_fails_before_the_long_work(tmp_path, where):
    (tmp_path / "f").write_text("a file")
    bad = tmp_path / "f" / "results" if where == "file" else Path("/sys/no_results_here")
    env = dict(_env(tmp_path), RESULTS=str(bad))
    p = run_stage(["0_prepare_data.py", "--model", "efficientnet_lite0"], env, check=False)
    assert p.returncode == 1 and f"cannot create {bad}" in p.stderr, p.stderr
    assert "preprocess" not in p.stderr  # refused before decoding any image
    assert not (tmp_path / "a" / "splits.json").exists()


def _stage0_peak_mb(data: Path, env: dict) -> tuple[object, float]:
    """Run stage 0 on ``data`` in a child that reports its own peak RSS (MB) on stderr."""
    import subprocess
    import sys

    code = ("import resource, runpy, sys\n"
            "sys.argv = ['0_prepare_data.py', '--model', 'efficientnet_lite0', '--data-root', "
            f"{str(data)!r}, '--allow-class-subset']\n"
            "try:\n    runpy.run_path('0_prepare_data.py', run_name='__main__')\nfinally:\n"
            "    print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
            "file=sys.stderr)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True)
    kb = [ln.split()[1] for ln in p.stderr.splitlines() if ln.startswith("PEAK_KB")]
    return p, int(kb[0]) / 1024


@pytest.mark.slow
def test_stage0_names_unread_formats_and_a_strip_image_keeps_the_peak_memory(tmp_path):
    """Files in formats not read are counted and named on stderr and in the records; an
    8000x1 image (2048000x256 once resized, 1.5 GB) adds nothing to stage 0's peak memory."""
    from PIL import Image

    data = _class_folders(tmp_path / "data", SAMPLE[:4])
    p0, base_mb = _stage0_peak_mb(data, _env(tmp_path))
    assert p0.returncode == 0, p0.stderr
    wnid = SAMPLE[0].name[:9]
    Image.new("RGB", (8000, 1), (200, 10, 10)).save(data / wnid / "strip.png")
    (data / wnid / "phone.heic").write_bytes(b"\0\0\0\x18ftypheic")
    p, strip_mb = _stage0_peak_mb(data, _env(tmp_path))
    assert p.returncode == 0, p.stderr
    assert (f"WARNING: 1 file(s) in {data} have an image suffix this pipeline does not read "
            f"(1 .heic): not used: {wnid}/phone.heic; convert them to JPEG or PNG") in p.stderr
    assert ", 1 in a format not read ->" in p.stdout
    summary = json.loads((tmp_path / "r" / "efficientnet_lite0" / "data.json").read_text())
    split = json.loads((tmp_path / "a" / "splits.json").read_text())
    assert summary["n_unread_format"] == 1 and split["unread_format"] == [f"{wnid}/phone.heic"]
    assert summary["n_listed"] == 5 and summary["n_unreadable"] == 0
    assert strip_mb < 1.25 * base_mb, (strip_mb, base_mb)
