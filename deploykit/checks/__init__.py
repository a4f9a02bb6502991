"""Export and conversion checks: result shape (:mod:`.base`), graph lint (:mod:`.lint`),
export checks against PyTorch (:mod:`.export`) and FP16 conversion and verdicts (:mod:`.fp16`).
"""
