"""Which samples and positions carried a step: the Trace's attribution queries (analysis/attribution.py answers
them), kept apart from the rest of the Trace as a base class of it."""

from __future__ import annotations

import torch

from hookwidget.layers import registry
from hookwidget.trace.arguments import boundary, check_step, reduction_scale, trainable


class ShareQueries:
    """The methods of `Trace` that split a step's gradient over its samples and positions (`Trace` inherits them)."""

    @boundary
    def shares(self, name: str | None = None, step: int | None = None):
        """Each sample's share s_b = ⟨G_b, G⟩ / ‖G‖² of the step's gradient G, and each position's, as a Shares
        (.samples (N,), .positions (N, T), .unplaced, .by_layer, .left_out, .notes, .top(k)). Exact and
        additive: the samples' shares sum to 1; a negative one pulled against the step. name: a layer (the
        parameters it answers for), a parameter (t.params), or None (every parameter with an exact per-sample
        rule; .left_out names the rest). step: as per_sample_grads (under accumulation, all micro-batches).

        Example:

        ```python
        s = t.shares()
        s.top(3)              # [(index, share), ...], largest first
        s.positions[s.top(1)[0][0]]   # where in that sample the step came from
        ```
        """
        from hookwidget.analysis import attribution

        with registry.memo():
            return attribution.shares(self, name, check_step(self, step))

    @boundary
    def sample_shares(self, name: str | None = None, step: int | None = None) -> torch.Tensor:
        """(N,) each sample's share ⟨G_b, G⟩ / ‖G‖² of the step's gradient (t.shares(...).samples; what is left
        out: t.shares().left_out). They sum to 1.

        Example:

        ```python
        t.sample_shares().argmax()      # the sample that carried most of the step
        t.sample_shares("fc1")          # of one layer's gradient
        ```
        """
        return self.shares(name, step).samples

    @boundary
    def position_shares(self, name: str | None = None, step: int | None = None) -> torch.Tensor:
        """(N, T) each position's share ⟨G_{b,t}, G⟩ / ‖G‖² of the step's gradient, for one layer applied per
        position (a Linear on (B, T, d), an Embedding, a convolution's output positions, an LSTM's steps), or
        summed over the layers that share the sequence's T positions (name=None). What is not on a position
        (layers without a per-position form): t.shares(name).unplaced.

        Example:

        ```python
        t.position_shares()[b]          # which tokens of sample b carried the step
        ```
        """
        found = self.shares(name, step)
        if found.positions is None:
            raise ValueError(f"{name or 'the parameters counted'}: no layer applied per position among them (a "
                             "generic-rule or mapped layer has per-sample shares only): use t.sample_shares(name)")
        return found.positions

    @boundary
    def position_norms(self, name: str, step: int | None = None, loss_reduction: str = "sum") -> torch.Tensor:
        """(N, T) ‖G_{b,t}‖, the norm of each position's gradient of a layer applied per position: an outer
        product, so ‖δ_{b,t}‖·‖a_{b,t}‖ exactly (with its bias, over both).

        Example:

        ```python
        t.position_norms("h.0.mlp.c_fc")   # (B, T)
        ```
        """
        from hookwidget.analysis import attribution

        reduction_scale(loss_reduction, 1)
        trainable(self, self.layer(name).name)
        with registry.memo():
            norms = attribution.position_norms(self, name, check_step(self, step))
        return norms * reduction_scale(loss_reduction, norms.shape[0])
