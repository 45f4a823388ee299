"""Typed errors of the ROI part: each message says what is missing and what to do about it."""

from __future__ import annotations


class RoiError(ValueError):
    """The ROI cannot be computed from these inputs; the message is meant for the user as is."""


class NoMeasurementsError(RoiError):
    """The store holds no usable measurement of a pruned configuration in the selected window."""


class NoTrafficError(RoiError):
    """The request volume is zero, so there is no cost to compare (and no savings to pay anything back)."""


class RoiStoreError(RoiError):
    """The result store cannot be read (missing file, unreachable server, no schema yet)."""
