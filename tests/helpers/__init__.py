"""Helpers shared by several test modules (small model builders, stage and tool runners)."""
