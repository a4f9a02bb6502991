"""Quantization: calibration data, the ModelOpt runner, Q/DQ inspection and health checks,
MACs, INT4 repair and the mixed-precision search.
"""
