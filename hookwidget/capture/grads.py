"""The .grad each step of a trace leaves, copied when the step ends (the record must not change when the user's
code changes .grad later), and whether the latest copy is still what .grad holds when the trace ends."""

from __future__ import annotations

import weakref

from hookwidget._torch.tensors import version, versions
from hookwidget.capture.budget import Budget
from hookwidget.record.calls import PREVIOUS


class GradCopies:
    """Copies of leaves' .grad within the trace's budget; `state`: leaf -> (weakref to its .grad, version) as the
    last step left it (None: no .grad)."""

    def __init__(self, budget: Budget):
        self.budget = budget
        self.state: dict = {}

    def before(self, leaf):
        """.grad as a step starts: None (none), PREVIOUS (as the previous step left it) or a copy."""
        g = leaf.grad
        if g is None:
            return None
        state = self.state.get(leaf)
        if state is not None and state[0]() is g and state[1] == version(g):
            return PREVIOUS
        return self.budget.keep_grad(g)

    def after(self, step, steps: list) -> None:
        """step.after: the .grad of each leaf the step reached, copied as it ends; older copies give way to
        summaries past the budget."""
        leaves = list(step.before)
        grads = [leaf.grad for leaf in leaves]
        copies = iter(self.budget.copy_grads([g for g in grads if g is not None]))
        step.after.update(zip(leaves, [None if g is None else next(copies) for g in grads]))
        kept = [None if g is None else (weakref.ref(g), v) for g, v in zip(grads, versions(grads))]
        self.state.update(zip(leaves, kept))
        self.budget.trim_grad_copies(steps)

    def unchanged(self) -> dict:
        """leaf -> whether its .grad is still what the last step left (the same tensor, unwritten since)."""
        grads = [leaf.grad for leaf in self.state]
        return {leaf: state is None and g is None or state is not None and g is not None and state[0]() is g
                and state[1] == v for (leaf, state), g, v in zip(self.state.items(), grads, versions(grads))}
