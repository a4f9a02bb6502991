"""The command lines behind the root tool scripts (one module each; the root file is a wrapper).
"""
