"""Which samples and positions carried a step: the Trace's attribution queries (analysis/attribution.py answers
them), kept apart from the rest of the Trace as a base class of it."""

from __future__ import annotations

import torch

from hookwidget.layers import registry
from hookwidget.options import shown
from hookwidget.trace.arguments import boundary, check_step, reduction_scale, trainable


class ShareQueries:
    """The methods of `Trace` that split a step's gradient over its samples and positions (`Trace` inherits them)."""

    @boundary
    def shares(self, name: str | None = None, step: int | None = None, *, progress=None):
        """Each sample's share s_b = ⟨G_b, G⟩ / ‖G‖² of the step's gradient G, and each position's.

        Exact and additive: the samples' shares sum to 1, and a negative one pulled against the step. A sample's
        share is split over its positions where the layers are applied per position (a Linear on (B, T, d), an
        Embedding, a convolution's output positions, an LSTM's steps).

        Args:

        - `name`: a layer (the parameters it answers for), a parameter (`t.params`), or None (default): every
          parameter with an exact per-sample rule (`.left_out` names the rest, and why).
        - `step`: as `per_sample_grads`' (under accumulation, None takes every micro-batch).
        - `progress`: None, or a function called with the fraction done (0 to 1) after each parameter: the
          explorer's panel shows it where a big model's shares take over half a second.

        Returns:

        A `Shares`: `.samples` (N,); `.positions` (N, T), summed over the layers whose token axis has T
        positions, or None where no layer has positions; `.unplaced` (N,), the part of each sample's share not on
        a position (`samples = positions.sum(1) + unplaced`); `.by_layer` (layer -> its own positions' shares);
        `.params`, `.left_out`, `.notes`, `.total_sq` (‖G‖²); `.top(k)`, the k largest shares as (index, share).

        Raises:

        - `TypeError`: `name` is not a string, or `progress` is not callable.
        - `KeyError`: no such layer.
        - `ValueError`: no parameter with exact per-sample gradients among those asked, a step's gradient of zero,
          a trace that kept no (a, δ) (`capture="norms"` or `"summary"`), or a bad `step`.

        Example:

        ```python
        s = t.shares()
        s.top(3)                       # [(index, share), ...], largest first
        s.positions[s.top(1)[0][0]]    # where in that sample the step came from
        ```
        """
        from hookwidget.analysis import attribution

        if progress is not None and not callable(progress):
            raise TypeError(f"progress={shown(progress)}: pass a function of the fraction done, e.g. "
                            "progress=lambda f: print(f'{f:.0%}'), or None")
        with registry.memo():
            return attribution.shares(self, name, check_step(self, step), progress=progress)

    @boundary
    def sample_shares(self, name: str | None = None, step: int | None = None) -> torch.Tensor:
        """Each sample's share ⟨G_b, G⟩ / ‖G‖² of the step's gradient: `t.shares(name, step).samples`.

        Args:

        - `name`, `step`: as `shares`'.

        Returns:

        A tensor of shape (N,) that sums to 1 (what it leaves out: `t.shares(name).left_out`).

        Raises:

        As `shares`.

        Example:

        ```python
        t.sample_shares().argmax()      # the sample that carried most of the step
        t.sample_shares("fc1")          # of one layer's gradient
        ```
        """
        return self.shares(name, step).samples

    @boundary
    def position_shares(self, name: str | None = None, step: int | None = None) -> torch.Tensor:
        """Each position's share ⟨G_{b,t}, G⟩ / ‖G‖² of the step's gradient, for one layer applied per position (a
        Linear on (B, T, d), an Embedding, a convolution's output positions, an LSTM's steps), or summed over the
        layers that share the sequence's T positions (name=None).

        Args:

        - `name`, `step`: as `shares`'.

        Returns:

        A tensor of shape (N, T). What is not on a position (layers without a per-position form):
        `t.shares(name).unplaced`.

        Raises:

        As `shares`, and `ValueError` where no layer among those asked is applied per position (a generic-rule
        or mapped layer has per-sample shares only: `sample_shares` answers).

        Example:

        ```python
        t.position_shares()[0]          # which positions of sample 0 carried the step
        ```
        """
        found = self.shares(name, step)
        if found.positions is None:
            raise ValueError(f"{name or 'the parameters counted'}: no layer applied per position among them (a "
                             "generic-rule or mapped layer has per-sample shares only): use t.sample_shares(name)")
        return found.positions

    @boundary
    def position_norms(self, name: str, step: int | None = None, loss_reduction: str = "sum") -> torch.Tensor:
        """The norm ‖G_{b,t}‖ of each position's gradient of a layer applied per position: an outer product, so
        ‖δ_{b,t}‖·‖a_{b,t}‖ exactly (with its bias, over both).

        Args:

        - `name`: a layer name (`t.layers`) applied per position.
        - `step`: as `per_sample_grads`'.
        - `loss_reduction`: `"sum"` (default) or `"mean"`, as `per_sample_grads`'.

        Returns:

        A tensor of shape (N, T).

        Raises:

        - `TypeError`: `name` is not a string.
        - `KeyError`: no such layer.
        - `ValueError`: a layer without trainable parameters, without a per-position form, or whose steps have
          different numbers of positions; a bad `loss_reduction` or `step`.

        Example:

        ```python
        t.position_norms("fc1")          # (N, T): 8 samples, 5 positions
        ```
        """
        from hookwidget.analysis import attribution

        reduction_scale(loss_reduction, 1)
        trainable(self, self.layer(name).name)
        with registry.memo():
            norms = attribution.position_norms(self, name, check_step(self, step))
        return norms * reduction_scale(loss_reduction, norms.shape[0])
