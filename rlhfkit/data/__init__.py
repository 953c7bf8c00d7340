"""Datasets -> samples -> batches: readers and mixing, formatting, per-method sample builders, collation.

See docs/data.md.
"""
