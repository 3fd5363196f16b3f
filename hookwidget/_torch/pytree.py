"""Nested arguments (tuples, lists, dicts of tensors) flattened to their leaves and back.

Checked on torch 2.13. Why a private module: torch.utils._pytree is what torch.func and torch.compile flatten
arguments with, and torch has no public pytree module; its specs rebuild exactly the containers it flattened
(namedtuples, OrderedDicts, ModelOutputs registered with it), which a hand-written walk would not.
"""

from __future__ import annotations

from torch.utils import _pytree


def tree_flatten(tree) -> tuple:
    """(leaves, spec): the leaves of a nested structure, in a fixed order, and how they nest."""
    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves, spec):
    """The structure `spec` describes, with `leaves` in place of its leaves."""
    return _pytree.tree_unflatten(leaves, spec)
