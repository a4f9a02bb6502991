"""The one comparator: top-k accuracy, per-row cosine similarity, parity statistics of two
outputs, the per-precision tolerance table (:data:`TOLERANCES`) every check reads, and the
per-tensor statistic (:class:`TensorStat`) of the layer-wise tools.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence
import numpy as np
from typing import Any, Sequence

from deploykit.errors import StageError, UsageError


# --------------------------------------------------------------------------------------------
# Metrics (pure functions over saved outputs)
# --------------------------------------------------------------------------------------------
def topk_accuracy(logits: np.ndarray, labels: np.ndarray, ks: Sequence[int] = (1, 5)
                  ) -> dict[str, float]:
    """Top-k accuracy in percent.

    Args:
        logits: ``[N, C]`` scores. labels: int ``[N]``.
    Returns:
        ``{"top1": %, "top5": %}`` for ``ks=(1, 5)``.
    """
    logits = np.asarray(logits, np.float32)
    labels = np.asarray(labels)
    order = np.argsort(-logits, axis=1, kind="stable")
    out = {}
    for k in ks:
        hit = (order[:, :k] == labels[:, None]).any(axis=1)
        out[f"top{k}"] = float(100.0 * hit.mean()) if len(labels) else float("nan")
    return out


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of each row of ``a`` and ``b`` (float64 ``[N]``).

    Args:
        a, b: ``[N, ...]`` arrays of the same shape (flattened per row); a 0-d or 1-d array is
            one row. Two all-zero rows have cosine 1; NaN/Inf propagate.
    """
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    a = a.reshape(len(a), -1) if a.ndim > 1 else a.reshape(1, -1)
    b = b.reshape(len(b), -1) if b.ndim > 1 else b.reshape(1, -1)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where((na == 0) & (nb == 0), 1.0, (a * b).sum(1) / np.maximum(na * nb, 1e-300))


def parity(ref: np.ndarray, out: np.ndarray) -> dict[str, float]:
    """Numerical parity of ``out`` against reference outputs ``ref`` (same shape).

    Cosine similarity is computed per sample over the flattened remaining axes, in float64.
    Returns:
        ``cosine_mean``, ``cosine_min``, ``top1_agreement`` (%, argmax over the last axis, only
        for 2-D outputs), ``max_abs_err``, ``mean_abs_err``.
    Raises:
        StageError: shapes differ.
    """
    ref = np.asarray(ref, np.float64)
    out = np.asarray(out, np.float64)
    if ref.shape != out.shape:
        raise StageError(f"parity: output shape {out.shape} != reference {ref.shape}")
    cos = cosine_rows(ref, out)
    err = np.abs(ref - out)
    res = {"cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
           "max_abs_err": float(err.max()), "mean_abs_err": float(err.mean())}
    if ref.ndim == 2:
        res["top1_agreement"] = float(100.0 * (ref.argmax(1) == out.argmax(1)).mean())
    return res


# --------------------------------------------------------------------------------------------
# Tolerances
# --------------------------------------------------------------------------------------------
#: Default per-precision tolerances. A tensor passes when
#: ``cosine_min >= min_cosine`` AND ``max_abs_err <= atol + rtol * max|ref|``.
#:
#: Why these numbers (1 - cos ~= e^2 / 2 for a relative RMS error e):
#:
#: - ``fp32``: two FP32 runs differ only by summation order (~1e-7 relative per op, growing
#:   slowly with depth), so cosine >= 0.9999 (e ~ 1.4 %) and rtol 1e-3 of the tensor's range
#:   leave two orders of magnitude of margin and still flag a single wrong weight or op.
#: - ``tf32``: TF32 (TensorRT's default for FP32 on Ampere+, ORT CUDA) rounds matmul/conv inputs
#:   to a 10-bit mantissa (unit roundoff 4.9e-4); cosine >= 0.9995, rtol 5e-3.
#: - ``fp16``: same 10-bit mantissa for every tensor plus FP16 accumulation in some kernels;
#:   typical layer errors are 1e-3..1e-2 relative, so cosine >= 0.999 (e ~ 4.5 %) avoids false
#:   alarms on deep CNNs while a wrong layer (cosine < 0.9 in practice) still fails. rtol 0.1:
#:   measured on EfficientNet-Lite0 (fp16.onnx vs fp32.onnx, 8 real images), the ReLU6 (Clip)
#:   outputs of a healthy FP16 model reach max abs errors of 4-7 % of max|ref| (single elements
#:   near the clip point) at cosine 0.99998; 2e-2 flagged ten of them as divergent.
#: - ``int8``: per-tensor INT8 steps are range/255 (0.4 %) per quantised tensor and accumulate
#:   through the graph; healthy PTQ models keep per-layer cosine at 0.99..0.9999 (ORT's own
#:   ``qdq_loss_debug`` reports the same statistic), so 0.98 is the alarm line. Max abs error is
#:   dominated by single elements that cross a ReLU6/Clip threshold (an error of the whole
#:   range on efficientnet_lite0 while cosine stays > 0.99), hence rtol 1.0: cosine decides,
#:   max abs only catches errors larger than the tensor's range.
#: - ``int4``: weight-only INT4 blocks (AWQ/RTN) have 16 levels; cosine >= 0.95, rtol 2.0.
TOLERANCES: dict[str, dict[str, float]] = {
    "fp32": {"min_cosine": 0.9999, "atol": 1e-5, "rtol": 1e-3},
    "tf32": {"min_cosine": 0.9995, "atol": 1e-4, "rtol": 5e-3},
    "fp16": {"min_cosine": 0.999, "atol": 1e-3, "rtol": 0.1},
    "int8": {"min_cosine": 0.98, "atol": 1e-2, "rtol": 1.0},
    "int4": {"min_cosine": 0.95, "atol": 1e-2, "rtol": 2.0},
}


def tolerances_for(precision: str, overrides: dict[str, float] | None = None) -> dict[str, float]:
    """Tolerances for ``precision`` (a key of :data:`TOLERANCES`) with ``overrides`` applied.

    Raises:
        UsageError: unknown precision.
    """
    if precision not in TOLERANCES:
        raise UsageError(f"precision {precision!r}: choose one of {sorted(TOLERANCES)}")
    tol = dict(TOLERANCES[precision])
    for k, v in (overrides or {}).items():
        if v is not None:
            if k not in tol:
                raise UsageError(f"tolerance {k!r}: choose from {sorted(tol)}")
            tol[k] = float(v)
    return tol


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TensorStat:
    """Running comparison of one tensor over chunks of samples (float64 arithmetic).

    ``cosines`` holds one cosine per sample (axis 0 = batch) or one per chunk when the tensor
    has no batch axis; ``max_abs_err`` and ``ref_abs_max`` are maxima over all elements.
    """

    shape_a: tuple = ()
    shape_b: tuple = ()
    dtype_b: str = ""
    cosines: list = dataclasses.field(default_factory=list)
    max_abs_err: float = 0.0
    sum_abs_err: float = 0.0
    count: int = 0
    ref_abs_max: float = 0.0
    nonfinite_b: int = 0
    mismatch: str | None = None
    exact: bool | None = None

    def update(self, a: np.ndarray, b: np.ndarray, n_batch: int) -> None:
        a, b = np.asarray(a), np.asarray(b)
        self.shape_a, self.shape_b, self.dtype_b = tuple(a.shape), tuple(b.shape), str(b.dtype)
        if a.shape != b.shape:
            if a.size == b.size:
                b = b.reshape(a.shape)  # e.g. TensorRT's [N, C] vs [N, C, 1, 1]
            else:
                self.mismatch = f"shape {tuple(b.shape)} vs reference {tuple(a.shape)}"
                return
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(b.dtype, np.floating)):
            # Integer tensors (shapes, indices, quantised values): exact, except that 8-bit
            # quantised values may differ by one step (round-half-even vs away from zero).
            diff = np.abs(a.astype(np.int64) - b.astype(np.int64)) if a.size else np.zeros(1)
            step_ok = a.dtype.itemsize == 1 and diff.max() <= 1
            eq = bool(diff.max() == 0 or step_ok)
            self.exact = eq if self.exact is None else (self.exact and eq)
            return
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        self.nonfinite_b += int((~np.isfinite(b64) & np.isfinite(a64)).sum())
        per_sample = a64.ndim >= 2 and a64.shape[0] == n_batch
        cos = cosine_rows(a64, b64) if per_sample else cosine_rows(
            a64.reshape(1, -1), b64.reshape(1, -1))
        self.cosines.extend(cos.tolist())
        err = np.abs(a64 - b64)
        if err.size:
            self.max_abs_err = max(self.max_abs_err, float(np.max(err)))
            self.sum_abs_err += float(np.sum(err))
            self.ref_abs_max = max(self.ref_abs_max, float(np.max(np.abs(a64))))
        self.count += err.size

    def result(self, tol: dict[str, float]) -> dict:
        """Summary dict with ``status`` ``pass``/``fail`` under ``tol``."""
        out: dict[str, Any] = {"shape": list(self.shape_a), "dtype_b": self.dtype_b}
        if self.mismatch:
            return {**out, "status": "fail", "note": self.mismatch}
        if self.exact is not None:
            return {**out, "status": "pass" if self.exact else "fail", "exact_match": self.exact,
                    "cosine_min": 1.0 if self.exact else 0.0}
        cos = np.asarray(self.cosines, np.float64)
        cmin = float(np.min(cos)) if cos.size else float("nan")
        rel = self.max_abs_err / self.ref_abs_max if self.ref_abs_max > 0 else (
            0.0 if self.max_abs_err == 0 else float("inf"))
        ok = (np.isfinite(cmin) and cmin >= tol["min_cosine"] and self.nonfinite_b == 0
              and np.isfinite(self.max_abs_err)
              and self.max_abs_err <= tol["atol"] + tol["rtol"] * self.ref_abs_max)
        res = {**out, "status": "pass" if ok else "fail", "cosine_min": cmin,
               "cosine_mean": float(np.mean(cos)) if cos.size else float("nan"),
               "max_abs_err": self.max_abs_err,
               "mean_abs_err": self.sum_abs_err / self.count if self.count else float("nan"),
               "rel_err": rel, "ref_abs_max": self.ref_abs_max}
        if self.nonfinite_b:
            res["note"] = f"{self.nonfinite_b} NaN/Inf values where the reference is finite"
        return res


def compare_outputs(ref: dict[str, np.ndarray], out: dict[str, np.ndarray],
                    tol: dict[str, float]) -> dict[str, dict]:
    """Compare final outputs by name (``out`` may lack some) with :class:`TensorStat`."""
    res = {}
    for name, a in ref.items():
        if name not in out:
            res[name] = {"status": "missing"}
            continue
        st = TensorStat()
        st.update(a, out[name], len(a) if np.ndim(a) else 1)
        res[name] = st.result(tol)
    return res
