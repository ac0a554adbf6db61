"""Speculative decoding (--speculative-algorithm): drafters and draft-tree verification."""
