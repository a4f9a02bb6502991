"""Layer-wise parity: which layer is wrong, and why.
"""
