"""Losses, one family per file; each takes ``gather`` (a name, a callable, or None)."""

from gatherlab.losses.ntxent import NTXentGlobalLoss, NTXentLoss

__all__ = ["NTXentGlobalLoss", "NTXentLoss"]
