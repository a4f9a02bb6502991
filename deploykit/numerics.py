"""FP16 limits used by the range checks (IEEE 754 binary16).
"""
from __future__ import annotations

import numpy as np



FP16_MAX = float(np.finfo(np.float16).max)                      # 65504


FP16_MIN_NORMAL = float(np.finfo(np.float16).tiny)              # 6.10e-05


FP16_MIN_SUBNORMAL = float(np.finfo(np.float16).smallest_subnormal)  # 5.96e-08


FP16_MIN_SUBNORMAL = float(np.finfo(np.float16).smallest_subnormal)  # 5.96e-08


FP16_MIN_NORMAL = float(np.finfo(np.float16).tiny)  # 6.10e-05


FP16_MIN_NORMAL = float(np.finfo(np.float16).tiny)  # 2^-14 = 6.10e-05
