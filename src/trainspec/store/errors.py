"""Typed errors of the run store."""

from __future__ import annotations


class StoreError(RuntimeError):
    """A run cannot be read or written; the message names the path and the reason."""
