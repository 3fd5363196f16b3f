"""t.token_ids() / t.token_layer() (analysis/tokens.py): the ids are the input the traced code fed its embedding,
read back row by row along the dim capture proved to hold the samples; where no embedding (or several) qualifies,
one line names the fix. The references are the tensors the test itself fed the model."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookwidget as hw

V, D, T, B = 11, 5, 6, 4


class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        return self.head(self.tok(idx))


class TwoTables(nn.Module):
    """A token table and a segment table, both fed one (B, T) row of ids: which is the tokens' is not provable."""

    def __init__(self):
        super().__init__()
        self.tok, self.seg, self.head = nn.Embedding(V, D), nn.Embedding(2, D), nn.Linear(D, V)

    def forward(self, idx, seg):
        return self.head(self.tok(idx) + self.seg(seg))


def lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), reduction="sum")


def test_the_ids_are_the_embeddings_input_row_by_row():
    torch.manual_seed(0)
    model, idx, y = Tokens(), torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))

    def step():
        model.zero_grad()
        lm_loss(model(idx), y).backward()

    t = hw.trace(step)
    assert torch.equal(t.token_ids(), idx) and t.token_layer() == "tok"
    assert torch.equal(t.token_ids(positions=T), idx)
    with pytest.raises(ValueError, match=f"no nn.Embedding's input is one row of {T + 1} ids per sample"):
        t.token_ids(positions=T + 1)
    for bad in (0, "6", True):
        with pytest.raises(ValueError, match="positions=") as e:
            t.token_ids(positions=bad)
        assert len(str(e.value).splitlines()) == 1


def test_time_major_ids_are_transposed_along_the_proven_samples_dim():
    torch.manual_seed(0)
    model, ids = Tokens(), torch.randint(0, V, (B, B))  # (T, B) with T == B: shapes alone cannot tell

    def step():
        model.zero_grad()
        lm_loss(model(ids), torch.randint(0, V, (B, B))).backward()

    assert torch.equal(hw.trace(step, batch_dim=1).token_ids(), ids.T)


def test_micro_batches_give_their_samples_in_order_and_reset_steps_ask_for_one():
    torch.manual_seed(0)
    model = Tokens()
    batches = [torch.randint(0, V, (B, T)) for _ in range(2)]

    def accumulate():
        model.zero_grad()
        for idx in batches:
            lm_loss(model(idx), idx).backward()

    def reset_each():
        for idx in batches:
            model.zero_grad()
            lm_loss(model(idx), idx).backward()

    assert torch.equal(hw.trace(accumulate).token_ids(), torch.cat(batches))
    t = hw.trace(reset_each)
    with pytest.raises(ValueError, match="pass step=k"):
        t.token_ids()
    assert torch.equal(t.token_ids(step=1), batches[1])


def test_two_qualifying_tables_need_the_users_name_and_a_wrong_name_says_why():
    torch.manual_seed(0)
    model = TwoTables()
    idx, seg, y = torch.randint(0, V, (B, T)), torch.randint(0, 2, (B, T)), torch.randint(0, V, (B, T))

    def step():
        model.zero_grad()
        lm_loss(model(idx, seg), y).backward()

    with pytest.raises(ValueError, match=r"tok, seg all take one row of ids per sample.*token_layer='tok'") as e:
        hw.trace(step).token_ids()
    assert len(str(e.value).splitlines()) == 1
    assert torch.equal(hw.trace(step, token_layer="tok").token_ids(), idx)
    assert torch.equal(hw.trace(step, token_layer="seg").token_ids(), seg)  # the user's word: a table of ids
    with pytest.raises(ValueError, match=r"token_layer 'head': its input \(4, 6, 5\)"):
        hw.trace(step, token_layer="head").token_ids()
    with pytest.raises(ValueError, match=r"token_layer='wte' is not a layer of this trace.*\(tok, seg\)"):
        hw.trace(step, token_layer="wte").token_layer()


def test_without_kept_inputs_or_an_embedding_it_says_what_to_do():
    torch.manual_seed(0)
    model, idx = Tokens(), torch.randint(0, V, (B, T))

    def step():
        model.zero_grad()
        lm_loss(model(idx), idx).backward()

    with pytest.raises(ValueError, match=r"\(tok: its input was not kept .*raise budget_mb\).*token_layer='wte'"):
        hw.trace(step, capture="summary").token_ids()
    with pytest.raises(ValueError, match="its input was not kept"):
        hw.trace(step, capture="summary", token_layer="tok").token_ids()
    mlp, x = nn.Linear(3, 2), torch.randn(B, T, 3)
    with pytest.raises(ValueError, match="no nn.Embedding's input"):
        hw.trace(lambda: mlp(x).sum().backward()).token_ids()


def test_the_magic_with_decode_says_in_one_line_when_there_are_no_ids(capsys):
    from IPython.testing import globalipapp

    globalipapp.start_ipython()
    ip = globalipapp.get_ipython()
    ip.run_line_magic("load_ext", "hookwidget")
    torch.manual_seed(0)
    ip.user_ns.update(mlp=nn.Linear(3, 2), x=torch.randn(B, T, 3), tokens_model=Tokens(),
                      idx=torch.randint(0, V, (B, T)), vocab_of=lambda i: f"w{i}")
    try:
        ip.run_cell_magic("hooktrace", "-o T1 --no-widget --decode vocab_of", "mlp(x).sum().backward()\n")
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("%%hooktrace --decode: token ids: no nn.Embedding's input")
        assert "--token-layer" in err[0]
        ip.run_cell_magic("hooktrace", "-o T2 --no-widget --decode vocab_of", "tokens_model(idx).sum().backward()\n")
        assert "--decode" not in capsys.readouterr().err
        assert torch.equal(ip.user_ns["T2"].token_ids(), ip.user_ns["idx"])
    finally:
        for k in ("T1", "T2", "mlp", "x", "tokens_model", "idx", "vocab_of", "_hooktrace"):
            ip.user_ns.pop(k, None)
