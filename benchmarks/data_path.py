#!/usr/bin/env python3
"""Data path: the pipeline's uint8 preprocessing cache build against torchvision's ``ImageFolder``
+ ``DataLoader`` with the same transforms, in images per second, and the tensors asserted equal.

Both decode the same JPEG files with PIL, resize the short side (antialiased, the model's
interpolation), center-crop and produce uint8 CHW tensors; normalisation happens later in both.
The ImageFolder side sees the embedded flat sample through class folders of symlinks.

Usage (project root, after ``source env.sh``):
    python benchmarks/data_path.py --model efficientnet_lite0 --n 300 --workers 2
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deploykit.cli import HelpFormatter, add_shared_args, int_at_least  # noqa: E402
from deploykit.data.images import list_images  # noqa: E402
from deploykit.data.splits import preprocess_items  # noqa: E402
from deploykit.envinfo import device_info  # noqa: E402
from deploykit.io import write_json  # noqa: E402
from deploykit.layout import DEFAULT_DATA  # noqa: E402
from deploykit.models import model_spec  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    add_shared_args(p, "model")
    p.add_argument("--n", type=int_at_least(1), default=300,
                   help="images (the first N of the sample)")
    p.add_argument("--workers", type=int_at_least(0), default=2,
                   help="DataLoader workers")
    p.add_argument("--batch", type=int_at_least(1), default=64,
                   help="DataLoader batch size")
    p.add_argument("--rounds", type=int_at_least(1), default=3,
                   help="interleaved rounds (median reported)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/data_path.json"),
                   help="JSON output")
    args = p.parse_args()
    import torch
    import torchvision.transforms.v2 as T
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import InterpolationMode

    spec = model_spec(args.model)
    items, _ = list_images(DEFAULT_DATA)
    items = items[:args.n]
    prep = spec.preprocessing()

    mode = {"bilinear": InterpolationMode.BILINEAR, "bicubic": InterpolationMode.BICUBIC,
            "nearest": InterpolationMode.NEAREST}[spec.interpolation]
    tf = T.Compose([T.Resize(spec.resize, interpolation=mode, antialias=True),
                    T.CenterCrop(spec.crop), T.PILToTensor()])
    t_ours, t_tv = [], []
    with tempfile.TemporaryDirectory() as d:
        for rel, _ in items:  # one class folder per WNID: ImageFolder's sorted order = ours
            (Path(d) / rel[:9]).mkdir(exist_ok=True)
            (Path(d) / rel[:9] / rel).symlink_to((DEFAULT_DATA / rel).resolve())
        ds = ImageFolder(d, transform=lambda im: tf(im.convert("RGB")))
        for _ in range(args.rounds):  # interleaved: the page cache and drift affect both
            t0 = time.perf_counter()
            ours, good, bad = preprocess_items(DEFAULT_DATA, items, prep,
                                               desc="cache")
            t_ours.append(time.perf_counter() - t0)
            assert not bad, bad
            dl = torch.utils.data.DataLoader(ds, batch_size=args.batch,
                                             num_workers=args.workers)
            t0 = time.perf_counter()
            theirs = torch.cat([x for x, _ in dl]).numpy()
            t_tv.append(time.perf_counter() - t0)
    t_ours, t_tv = float(np.median(t_ours)), float(np.median(t_tv))
    assert theirs.dtype == np.uint8 and theirs.shape == ours.shape
    equal = bool(np.array_equal(theirs, ours))
    assert equal, f"max abs diff {np.abs(theirs.astype(int) - ours).max()}"
    out = {"machine": device_info(), "date_utc": time.strftime("%Y-%m-%d"),
           "n_images": len(items), "preprocessing": prep,
           "cache_build_images_per_s": len(items) / t_ours,
           "imagefolder_dataloader_images_per_s": len(items) / t_tv,
           "dataloader_workers": args.workers, "rounds": args.rounds, "tensors_equal": equal}
    write_json(args.out, out)
    print(f"uint8 cache build (1 process): {out['cache_build_images_per_s']:.1f} images/s; "
          f"ImageFolder + DataLoader ({args.workers} workers): "
          f"{out['imagefolder_dataloader_images_per_s']:.1f} images/s; tensors equal: {equal} "
          f"-> {args.out}")


if __name__ == "__main__":
    main()
