"""Which samples carried each watched step (`hw.watch(per_sample=True)`): each sample's share
s_b = ⟨G_b, G⟩ / ‖G‖² of the step's gradient G, and the top sample's top position, on device, no host sync.

Why shares and not only the largest norm: a norm says how hard a sample pulled, not whether it pulled with the
step; Σ_b s_b = 1 exactly, per parameter and over all of them (analysis/attribution.py, the Trace's, says more).

How, per parameter p of a layer with an exact (a, δ) rule (sample_stats.PerSample decides which):
- G_p comes from a hook on p itself (Tensor.register_hook on the leaf: this backward's gradient of p, summed
  over every layer that uses it, before it is added to .grad), so it is never rebuilt from the factors;
- the layer's factors (a, δ as layers/factors.py gives them) come from PerSample as it reduces the layer's norms;
- whichever of the two arrives second computes ⟨G_{b,t}, G_p⟩ = δ_btᵀ G_p a_bt per sample and position
  (layers/shares.py: one (tokens × out)(out × in) product), or, where the layer alone holds p and the Gram form
  is the cheaper (layers/share_gram.cheaper), from the token pairs as soon as the factors come.
A parameter's gradient arriving twice in one step (reentrant checkpointing backward through it twice) makes the
step's shares NaN (not known), as does Σ_b ⟨G_b, G⟩ differing from ‖G‖² (a use of p outside its layers).

What the row keeps (WIDTH floats after the two of the largest norm): the TOP samples by share, largest first, as
(index, share), and of the first of them the position with the largest share and that share (positions summed
over the layers whose token axis has the most common length, a tie to the longer; NaN where no layer has one).
"""

from __future__ import annotations

import torch

from hookwidget.capture.stat_rows import F64, NAN
from hookwidget.layers import factors as fx
from hookwidget.layers import share_gram
from hookwidget.layers import shares as sh

TOP = 3  # samples kept per step
WIDTH = 2 * TOP + 2  # (index, share) × TOP, then the first one's top position and its share
COLUMNS = 2 + WIDTH  # a step's per-sample column: [largest norm, its sample] and the shares
TOLERANCE = 1e-3  # relative: Σ_b ⟨G_b, G⟩ against ‖G‖², below which the factors make up G


class _StepShares:
    """One step's parts, on device: per parameter index its gradient (as the hook gave it, held only while a
    layer of it is still to be reduced) and its factors waiting for it; per number of rows the dots summed,
    ‖G‖² and Σ dots of the parameters counted; per (rows, positions) the position dots summed and the
    layers that gave them."""

    __slots__ = ("grads", "waiting", "fired", "gram", "heads", "dots", "sq", "dot_sum", "pos", "bad")

    def __init__(self):
        self.grads, self.waiting, self.fired, self.gram, self.heads = {}, {}, set(), {}, {}
        self.dots, self.sq, self.dot_sum, self.pos = {}, {}, {}, {}
        self.bad = False


class SampleShares:
    """The shares of per_sample=True: `layers` the watched layers, `eligible` those PerSample counts, `group`
    layer -> the layers it shares a parameter with (PerSample's)."""

    def __init__(self, layers: list, eligible: set, group: dict):
        self.layers, self.group = layers, group
        self.index: dict = {}  # id(parameter) -> its index in self.params
        self.params: list = []  # the trainable parameters of the eligible layers: each gets a hook
        self.owners: list = []  # per parameter, the eligible layers that hold it
        for li in sorted(eligible):
            for p in layers[li].parameters(recurse=False):
                if p.requires_grad and id(p) not in self.index:
                    self.index[id(p)] = len(self.params)
                    self.params.append(p)
                    self.owners.append([])
                if p.requires_grad:
                    self.owners[self.index[id(p)]].append(li)

    @staticmethod
    def _of(step) -> _StepShares:
        if step.shares is None:
            step.shares = _StepShares()
        return step.shares

    def factors(self, step, li: int, fs: list) -> None:
        """PerSample reduced layer li this step: its factors `fs` (their a and δ held until p's gradient comes)."""
        with torch.no_grad():
            self._factors(self._of(step), li, fs)

    def _factors(self, st: _StepShares, li: int, fs: list) -> None:
        module, by_param = self.layers[li], {}
        for f in fs:
            pi = self.index.get(id(_param(module, f.param)))
            if pi is not None:
                by_param.setdefault(pi, []).append(f)
        for pi, pfs in by_param.items():
            if li not in self.group and len(pfs) == 1 and pi not in st.fired and share_gram.cheaper(pfs):
                (pos,) = share_gram.position_dots(pfs)  # the layer alone makes p's gradient: its token pairs
                st.gram[pi] = pos.shape[0]  # ‖G‖² comes with G (grad): Σ dots must match it
                self._add(st, pi, li, pos, None)
            elif pi in st.grads:
                for f in pfs:
                    self._dot(st, pi, li, f, st.grads[pi])
            elif pi in st.fired:
                st.bad = True  # its gradient came and went before this layer's factors: not known this step
            else:
                st.waiting.setdefault(pi, []).extend((li, f) for f in pfs)

    def head(self, step, li: int, fs: list, w, ids: torch.Tensor) -> None:
        """A tied LM head reduced before its embedding's δ comes (PerSample._head_part), its vocabulary-wide δ let
        go now: its part with its own gradient G_h = Σ δ aᵀ (built here: autograd only gives the tied weight's
        sum G = G_h + G_e) and, for the embedding's part G_e, whose rows are the embedding's token ids only, δ
        at those ids: δ_btᵀ G a_bt = δ_btᵀ G_h a_bt + Σ_{v in ids} δ_bt[v] (G_e[v] · a_bt) (held: (B, T, tokens),
        an id met c times weighted 1/c at each of its places)."""
        with torch.no_grad():
            st = self._of(step)
            pi = self.index.get(id(_param(self.layers[li], w.param)))
            if pi is None or pi in st.fired or w.D.dim() != 3:
                st.bad = True
                return
            G_h = fx.summed_grad(w)
            rows = ids.reshape(-1).long()  # with repeats (unique() would wait for the device): each counted once
            once = torch.zeros(w.D.shape[-1], dtype=w.D.dtype, device=rows.device).index_add_(
                0, rows, torch.ones(rows.shape, dtype=w.D.dtype, device=rows.device))[rows].reciprocal()
            st.heads[pi] = (li, sh.position_dots(w, G_h), w.D[..., rows] * once, w.X, rows,
                            G_h.reshape(w.D.shape[-1], -1)[rows])
            self._factors(st, li, [f for f in fs if f is not w])

    def grad(self, step, pi: int, g: torch.Tensor) -> None:
        """Parameter pi's gradient of this backward arrived (its hook)."""
        st = self._of(step)
        if pi in st.fired:
            st.bad = True  # its gradient came twice this step: the step's G is not any one of them
            return
        st.fired.add(pi)
        if pi in st.gram:
            st.sq.setdefault(st.gram[pi], {})[pi] = torch.linalg.vector_norm(g.reshape(-1), dtype=F64).square()
            return
        p = self.params[pi]
        if type(g) is not torch.Tensor or g.shape != p.shape or g.is_sparse:
            st.bad = True  # a sharded or sparse gradient (Embedding(sparse=True)): not the parameter's dense G
            return
        if pi in st.heads:
            head, own, at_rows, X, rows, G_h = st.heads.pop(pi)
            with torch.no_grad():
                G_e = g.reshape(g.shape[0], -1)[rows].to(G_h.dtype) - G_h
                pos = own + torch.einsum("btu,ud,btd->bt", at_rows, G_e, X)
                sq = torch.linalg.vector_norm(g.reshape(-1), dtype=F64).square()
            self._add(st, pi, head, pos, sq)
        for li, f in st.waiting.pop(pi, []):
            self._dot(st, pi, li, f, g)
        if any(li in step.ps_calls for li in self.owners[pi]):  # a layer of it reduced later (end of step)
            st.grads[pi] = g

    def _dot(self, st: _StepShares, pi: int, li: int, f, g: torch.Tensor) -> None:
        with torch.no_grad():
            G = g.to(f.D.dtype) if f.D.is_floating_point() and g.dtype != f.D.dtype else g
            pos = sh.position_dots(f, G)
            first = pi not in st.sq.get(f.D.shape[0], {})
            sq = torch.linalg.vector_norm(g.reshape(-1), dtype=F64).square() if first else None
            self._add(st, pi, li, pos if pos is not None else sh.sample_dots(f, G).unsqueeze(1), sq,
                      positional=pos is not None)

    @staticmethod
    def _add(st: _StepShares, pi: int, li: int, pos: torch.Tensor, sq, positional: bool = True) -> None:
        """(B, T) dots `pos` of a factor of parameter pi in layer li (T 1 where they have no positions), ‖G_pi‖²
        once."""
        n = pos.shape[0]
        pos = pos.to(F64)
        dots = pos.sum(1)
        st.dots[n] = st.dots[n] + dots if n in st.dots else dots
        st.dot_sum[n] = st.dot_sum[n] + dots.sum() if n in st.dot_sum else dots.sum()
        if sq is not None:
            st.sq.setdefault(n, {})[pi] = sq
        if positional and pos.dim() == 2:
            key = (n, pos.shape[1])
            held = st.pos.get(key)
            st.pos[key] = (pos, {li}) if held is None else (held[0] + pos, held[1] | {li})

    def row(self, step, batch: int | None, dev) -> torch.Tensor:
        """The step's WIDTH floats (float64, on dev): NaN where not known."""
        st, step.shares = step.shares, None
        nan = torch.full((WIDTH,), NAN, dtype=F64, device=dev)
        if st is None or st.bad or batch is None or batch not in st.dots or not st.sq.get(batch):
            return nan  # (factors still waiting: their parameter got no gradient, not part of the step's G)
        total = sum(st.sq[batch].values()).to(dev)
        s = st.dots[batch].to(dev) / total
        known = (total > 0) & ((st.dot_sum[batch].to(dev) - total).abs() <= TOLERANCE * total)
        k = min(TOP, batch)
        values, idx = torch.topk(s, k)
        out = torch.stack([idx.to(F64), values], 1).flatten()
        got = [(T, len(c)) for (n, T), (_, c) in st.pos.items() if n == batch and T > 1]
        if got:
            T = max(got, key=lambda tc: (tc[1], tc[0]))[0]
            strip = st.pos[(batch, T)][0].to(dev).index_select(0, idx[:1]).view(-1) / total
            share, t = torch.max(strip, 0)
            tail = torch.stack([t.to(F64), share])
        else:
            tail = torch.full((2,), NAN, dtype=F64, device=dev)
        out = torch.cat([out, torch.full((2 * (TOP - k),), NAN, dtype=F64, device=dev), tail])
        return torch.where(known, out, nan)


def _param(module, name: str):
    """The parameter a factor is of (its name may be dotted: a submodule's)."""
    for part in name.split("."):
        module = getattr(module, part)
    return module
