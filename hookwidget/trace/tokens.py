"""Which of the model call's inputs are the token ids: the Trace's queries (analysis/tokens.py proves it), kept
apart from the rest of the Trace as a base class of it. The explorer's token strip and `%%hooktrace --decode`
read the ids through them."""

from __future__ import annotations

import torch

from hookwidget.trace.arguments import boundary, check_step


class TokenQueries:
    """The methods of `Trace` that find the token ids among what the traced code fed its layers."""

    @boundary
    def token_ids(self, step: int | None = None, positions: int | None = None) -> torch.Tensor:
        """The token ids of every sample, one row each, as the model's embedding read them: what `decode=` turns
        into the text of the explorer's token strip.

        Proved, not guessed: the input of the `nn.Embedding` that `token_layer=` names (hw.trace's option), else of
        the only `nn.Embedding` whose input is, in every step asked for, one integer row per sample along the dim
        capture proved to hold the samples (a time-major (T, B) input is transposed). Where none or several
        qualify, it says so and names the fix.

        Args:

        - `step`: as `shares`' (None: every backward pass that accumulates into the step's gradient, their samples
          in order; or the only one).
        - `positions`: only embeddings whose rows hold this many ids (None: any number).

        Returns:

        A CPU tensor of shape (N, T): row b holds sample b's ids, as `t.shares().positions[b]` holds its
        positions' shares.

        Raises:

        - `ValueError`: no `nn.Embedding` (or several) takes one row of ids per sample, the `token_layer` option
          names a layer whose input is not that, its input was not kept (`capture="summary"`, the memory budget),
          or a bad `step` or `positions`.

        Example:

        ```python
        emb, ids = nn.Embedding(10, 4), torch.randint(0, 10, (8, 5))   # 8 samples of 5 tokens


        def lm_step():
            emb.zero_grad()
            model(emb(ids)).sum().backward()


        t_lm = hw.trace(lm_step)
        t_lm.token_ids()[0].tolist()         # sample 0's token ids: ids[0].tolist()
        ```
        """
        from hookwidget.analysis import tokens

        return tokens.token_ids(self, check_step(self, step), positions)

    @boundary
    def token_layer(self, step: int | None = None, positions: int | None = None) -> str:
        """The layer whose input `token_ids` reads: the `token_layer` option's, else the only `nn.Embedding` that
        takes one integer row of ids per sample.

        Args:

        - `step`, `positions`: as `token_ids`'.

        Returns:

        The layer's name (a key of `t.layers`).

        Raises:

        As `token_ids`.

        Example:

        ```python
        emb = nn.Embedding(10, 4)
        t_lm = hw.trace(lambda: model(emb(torch.randint(0, 10, (8, 5)))).sum().backward())
        t_lm.token_layer()                   # 'Embedding': the name the trace gave emb (t_lm.layers)
        ```
        """
        from hookwidget.analysis import tokens

        return tokens.token_layer(self, check_step(self, step), positions)
