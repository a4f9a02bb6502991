"""Input-convention probe of an image classifier whose FP32/FP16 row failed parity: feed the
same few images with the channels reversed (RGB<->BGR), unnormalised in 0..1 and in 0..255, and
say which convention, if any, restores parity with the PyTorch reference.

An FP32 file that differs from PyTorch by more than summation order most often is not a wrong
export but a wrong input contract: a model trained on BGR (OpenCV) images, or one that
normalises inside its graph (a Mul/Add or Sub/Div at its input) and so normalises the
pipeline's already-normalised images a second time.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from deploykit.compare import parity, row_tolerance
from deploykit.data.images import normalize

#: At most this many samples are probed (the probe runs only on a row that is not ok).
MAX_SAMPLES = 8

#: A probe explains the failure when its ``cosine_min`` reaches the band's ok bound, or when
#: its distance to the reference (1 - cosine_min) is at most this fraction of the as-fed one.
FAR_BETTER = 0.01


@dataclasses.dataclass(frozen=True)
class Probe:
    """One input convention: ``feed(x_u8 [N,3,H,W] uint8, mean, std) -> float32 [N,3,H,W]``."""
    name: str
    feed: Callable[[np.ndarray, tuple, tuple], np.ndarray]
    cause: str
    how: str
    fix: str


PROBES: tuple[Probe, ...] = (
    Probe("bgr", lambda x, m, s: normalize(np.ascontiguousarray(x[:, ::-1]), m[::-1], s[::-1]),
          "the file expects BGR input", "reversed channels",
          "feed the channels in the order the model was trained on (reverse RGB<->BGR in the "
          "preprocessing), or fold the flip into the first convolution before export"),
    Probe("unnormalised_0_1", lambda x, m, s: x.astype(np.float32) / 255.0,
          "the file expects unnormalised input in 0..1 (it normalises inside its graph, or was "
          "trained without mean/std)", "unnormalised 0..1 input (x*std+mean)",
          "drop the mean/std normalisation from the preprocessing (the model's spec mean=0, "
          "std=1), or remove the normalisation from the exported graph"),
    Probe("unnormalised_0_255", lambda x, m, s: x.astype(np.float32),
          "the file expects unnormalised input in 0..255", "unnormalised 0..255 input",
          "feed raw pixel values (spec mean=0, std=1/255), or remove the normalisation from "
          "the exported graph"),
)


def probe_input_convention(run: Callable[[np.ndarray], np.ndarray], x_u8: np.ndarray,
                           ref: np.ndarray, mean, std, precision: str,
                           n: int = MAX_SAMPLES) -> dict:
    """Which input convention, if any, brings a classifier's outputs back to the reference.

    Args:
        run: float32 images ``[n, 3, H, W]`` -> the compared output (logits ``[n, C]``).
        x_u8: uint8 images ``[N, 3, H, W]``; ``ref``: reference logits ``[N, C]`` (float32);
            only the first ``n`` (<= :data:`MAX_SAMPLES`) are probed.
        mean / std: the normalisation the pipeline feeds (per channel, 0..1 units).
        precision: the row's precision label (its band's ok bound, :func:`row_tolerance`).
    Returns:
        ``{"n_samples", "as_fed": parity, "probes": {name: parity}, "best": name | None,
        "cause": str | None, "fix": str | None}``; ``cause`` says the convention and its
        ``cosine_min``, e.g. ``"the file expects BGR input (parity with reversed channels:
        cosine min 0.99999)"``, when a probe restores parity (:data:`FAR_BETTER`).
    """
    n = min(n, MAX_SAMPLES, len(x_u8))
    x, r = x_u8[:n], np.asarray(ref[:n])
    mean, std = tuple(mean), tuple(std)
    ok_bound = row_tolerance(precision)[1]["cosine_min"]["ok"]
    as_fed = parity(r, run(normalize(x, mean, std)))
    out = {"n_samples": n, "as_fed": as_fed, "probes": {}, "best": None, "cause": None,
           "fix": None}
    best = None
    for p in PROBES:
        par = parity(r, run(p.feed(x, mean, std)))
        out["probes"][p.name] = par
        if best is None or par["cosine_min"] > out["probes"][best.name]["cosine_min"]:
            best = p
    bc = out["probes"][best.name]["cosine_min"]
    if bc >= ok_bound or (1.0 - bc) <= FAR_BETTER * (1.0 - as_fed["cosine_min"]):
        out.update(best=best.name, fix=best.fix,
                   cause=f"{best.cause} (parity with {best.how}: cosine min {bc:.6f} on "
                         f"{n} samples, as fed {as_fed['cosine_min']:.6f})")
    return out
