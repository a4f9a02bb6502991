"""Mixed precision for an accuracy budget (``int8_auto``).
"""
