"""deploykit.data.splits: calibration/evaluation/tuning splits, content duplicates, the uint8 cache
and its key, reference alignment."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deploykit.data.images import list_images
from deploykit.data.splits import (
    align_reference, cache_key, drop_content_duplicates, load_split, make_splits, split_tuning,
)
from deploykit.errors import StageError, UsageError
from deploykit.layout import DEFAULT_DATA
from deploykit.models import model_spec


# --------------------------------------------------------------------------------- splits
def test_tuning_split_is_carved_from_eval_seeded_and_off_by_default():
    items, _ = list_images(DEFAULT_DATA)
    ev, ca = make_splits(items, None, 10, 0.1, 0)
    assert split_tuning(ev, 0.0, 0) == (ev, [])  # default: the run is unchanged
    ev2, tu = split_tuning(ev, 0.25, 0)
    assert (len(ev2), len(tu)) == (675, 225)
    paths = [{p for p, _ in s} for s in (ev2, tu, ca)]
    assert not (paths[0] & paths[1]) and not (paths[1] & paths[2])
    assert paths[0] | paths[1] == {p for p, _ in ev}
    assert split_tuning(ev, 0.25, 0) == (ev2, tu)
    assert split_tuning(ev, 0.25, 1)[1] != tu
    # several images per class: every class keeps one for evaluation
    many = [(f"c{c}/{i}.JPEG", c) for c in range(20) for i in range(3)]
    ev3, tu3 = split_tuning(many, 0.9, 0)
    assert {c for _, c in ev3} == set(range(20)) and len(tu3) == 40
    with pytest.raises(UsageError, match="--tune-fraction"):
        split_tuning(ev, 1.0, 0)


DATA = DEFAULT_DATA


def test_splits_disjoint_seeded_and_documented_sizes():
    items, _ = list_images(DATA)
    ev, ca = make_splits(items, None, 10, 0.1, seed=0)
    assert len(ev) == 900 and len(ca) == 100
    assert not {p for p, _ in ev} & {p for p, _ in ca}
    assert make_splits(items, None, 10, 0.1, seed=0) == (ev, ca)
    assert make_splits(items, None, 10, 0.1, seed=1)[1] != ca
    ev0, ca0 = make_splits(items, None, 10, 0.0, seed=0)
    assert len(ev0) == 1000 and ca0 == []
    # several images per class: per-class counts, still disjoint
    many = [(f"c{c}/{i}.JPEG", c) for c in range(1000) for i in range(5)]
    ev, ca = make_splits(many, 3, 2, 0.1, seed=0)
    assert len(ca) == 2000 and len(ev) == 3000
    assert not {p for p, _ in ev} & {p for p, _ in ca}


def test_cache_key_changes_with_preprocessing_and_files():
    split = {"data_root": "/d", "eval": [["a", 0], ["b", 1]]}
    k = cache_key(split, "eval", {"resize": 256, "crop": 224, "interpolation": "bilinear"})
    assert k != cache_key(split, "eval", {"resize": 256, "crop": 224,
                                                 "interpolation": "bicubic"})
    assert k != cache_key({**split, "eval": [["a", 0]]}, "eval",
                                 {"resize": 256, "crop": 224, "interpolation": "bilinear"})


def test_splits_disjoint_by_content_not_only_path(tmp_path):
    a = tmp_path / "a.JPEG"
    a.write_bytes((DATA / "n01440764_tench.JPEG").read_bytes())
    (tmp_path / "a_link.JPEG").symlink_to(a)
    (tmp_path / "b.JPEG").write_bytes((DATA / "n01443537_goldfish.JPEG").read_bytes())
    kept, dropped = drop_content_duplicates(
        tmp_path, [("a_link.JPEG", 0), ("b.JPEG", 1)], [("a.JPEG", 0)])
    assert kept == [("b.JPEG", 1)] and dropped == ["a_link.JPEG"]


# ------------------------------------------------------------------------------- splits
def _old_make_splits(items, eval_per_class, calib_per_class, calib_fraction, seed):
    """The split rules before issue 11, for data that is all one-image or all many-image."""
    rng = np.random.default_rng(seed)
    by_class = {}
    for p, c in items:
        by_class.setdefault(c, []).append(p)
    ev, ca = [], []
    if max(len(v) for v in by_class.values()) == 1:
        classes = sorted(by_class)
        n_cal = int(round(calib_fraction * len(classes)))
        cal = set(rng.choice(classes, size=n_cal, replace=False).tolist()) if n_cal else set()
        for c in classes:
            (ca if c in cal else ev).append((by_class[c][0], c))
    else:
        for c in sorted(by_class):
            paths = sorted(by_class[c])
            chosen = [paths[i] for i in rng.permutation(len(paths))]
            ca += [(p, c) for p in chosen[:calib_per_class]]
            rest = chosen[calib_per_class:]
            ev += [(p, c) for p in (rest if eval_per_class is None else rest[:eval_per_class])]
    return sorted(ev), sorted(ca)


def test_splits_unchanged_where_the_old_rules_worked():
    items, _ = list_images(DATA)
    assert make_splits(items, None, 10, 0.1, 0) == _old_make_splits(items, None, 10, 0.1, 0)
    many = [(f"c{c}/{i}.JPEG", c) for c in range(50) for i in range(15)]
    assert make_splits(many, 3, 10, 0.1, 0) == _old_make_splits(many, 3, 10, 0.1, 0)


def test_few_images_per_class_never_give_an_empty_eval_split():
    items = [(f"c{c}/{i}.JPEG", c) for c in range(20) for i in range(3)]  # 3 per class
    assert not _old_make_splits(items, None, 10, 0.1, 0)[0]  # the old rules: 0 eval
    ev, ca = make_splits(items, None, 10, 0.1, 0)
    assert len(ev) == 20 and len(ca) == 40 and {c for _, c in ev} == set(range(20))
    assert not {p for p, _ in ev} & {p for p, _ in ca}


def test_one_stray_extra_image_does_not_empty_the_eval_split():
    items, _ = list_images(DATA)
    items = items + [("stray_a.JPEG", 3), ("stray_b.JPEG", 7)]  # two classes now have 2 images
    assert len(_old_make_splits(items, None, 10, 0.1, 0)[0]) == 0
    ev, ca = make_splits(items, None, 10, 0.1, 0)
    assert len(ev) == 900 and len(ca) == 102  # 100 held-out classes + 1 from each 2-image class


def test_calib_fraction_that_leaves_no_eval_names_the_flag():
    with pytest.raises(UsageError, match="lower --calib-fraction"):
        make_splits([("a.JPEG", 0)], None, 10, 0.9, 0)


def test_empty_eval_split_message_names_a_flag_that_helps(tmp_path, monkeypatch):
    monkeypatch.setenv("ARTIFACTS", str(tmp_path))
    (tmp_path / "splits.json").write_text(json.dumps({"data_root": "/x", "eval": [],
                                                      "calib": [["a", 0]]}))
    with pytest.raises(StageError, match="--calib-fraction or --calib-per-class"):
        load_split("eval", model_spec("efficientnet_lite0"))


@pytest.mark.slow
def test_truncated_cache_is_named_and_rebuilt(tiny_stage0, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ARTIFACTS", tiny_stage0["ARTIFACTS"])
    spec = model_spec("efficientnet_lite0")
    x0, y0, f0 = load_split("eval", spec)
    cache = next((tmp_path / "a" / "cache").glob("eval-*.npz"))
    cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2])
    x1, y1, f1 = load_split("eval", spec)
    err = capsys.readouterr().err
    assert cache.name in err and "rebuilding" in err
    np.testing.assert_array_equal(x0, x1)
    assert f0 == f1 and (y0 == y1).all()
    np.load(cache)["x"]  # the rebuilt file is whole


def test_truncated_reference_is_named_with_the_stage_that_rewrites_it(tmp_path):
    ref = tmp_path / "ref_logits.npz"
    np.savez(ref, logits=np.zeros((4, 10), np.float32), files=np.array(list("abcd")))
    ref.write_bytes(ref.read_bytes()[:100])
    with pytest.raises(StageError,
                       match=r"ref_logits\.npz is unreadable.*truncated.*1_pytorch_baseline\.py"):
        align_reference(ref, ["a"])
    np.savez(ref, logits=np.zeros((4, 10), np.float32))
    with pytest.raises(StageError, match=r"lacks \['files'\]"):
        align_reference(ref, ["a"])


def test_a_class_folder_that_cannot_be_listed_is_named_not_dropped(tmp_path, monkeypatch):
    """os.walk skips a folder it cannot list without a word: with ALLOW_CLASS_SUBSET its class
    vanished, without it the error blamed missing classes. (Root reads every folder, so the
    permission error is made by the walk itself.)"""
    import os

    import deploykit.data.images as images

    for wnid in ("n01440764", "n01443537"):
        (tmp_path / wnid / "sub").mkdir(parents=True)
        (tmp_path / wnid / "a.JPEG").write_bytes(b"x")
    real_walk = os.walk

    def walk(top, *a, onerror=None, **kw):
        if str(top).endswith("n01443537"):
            err = PermissionError(13, "Permission denied", str(top))
            if onerror is not None:
                onerror(err)
            return iter(())
        return real_walk(top, *a, onerror=onerror, **kw)

    monkeypatch.setattr(images.os, "walk", walk)
    with pytest.raises(StageError, match=r"cannot list .*n01443537 \(Permission denied\).*chmod"):
        list_images(tmp_path, allow_subset=True)
