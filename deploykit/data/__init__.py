"""Images and splits: reading and preprocessing images, and the calibration/evaluation splits.
"""
