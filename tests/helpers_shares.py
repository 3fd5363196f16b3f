"""Models and the loss that the share tests (test_attribution.py, the Trace's; test_watch_shares.py, the watch's)
both run against float64 autograd loops."""

from __future__ import annotations

from torch import nn


class RNN(nn.Module):
    """An LSTM then a Linear on its last output: the LSTM has only the generic rule."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.lstm(x)[0][:, -1])


def mse(model, x, y):
    """The summed squared error: each sample's loss adds up to the batch's (shares of a sum)."""
    return ((model(x) - y) ** 2).sum()
