"""The refusal every model-surface question raises where the model lacks what it needs."""

from __future__ import annotations


class MissingFeatureError(ValueError):
    """The model lacks a hook or feature an analysis needs (a ``ValueError`` naming it)."""
