"""Issue 25's models for the explorer's browser tests: a small CNN whose pool is called twice (after conv1 and
after conv2; its conv biases feed BatchNorms, so their gradients are float noise) and a 12-block Hugging Face
GPT-2 (tiny config, random weights: nothing downloaded); issue 41's GPT-2 124M (the same class at its default size,
batch 4 × 128). Each `*_source` is the code of a notebook cell; the functions run the same code here (`exec` of the
same text: one definition for both)."""

CNN_SOURCE = """\
import torch
import torch.nn as nn
import torch.nn.functional as F

class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        return self.fc(x.flatten(1))

torch.manual_seed(0)
cnn, cx, cy = CNN(), torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))

def cnn_step():
    cnn.zero_grad()
    F.cross_entropy(cnn(cx), cy).backward()
"""

GPT2_SOURCE = """\
import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                   bos_token_id=0, eos_token_id=0))
ids = torch.randint(0, 100, (2, 16))

def gpt2_step():
    gpt2.zero_grad()
    gpt2(ids, labels=ids).loss.backward()
"""

# GPT-2 small as issue 41 met it in a notebook: Hugging Face's 124M configuration, random weights, batch 4 × 128.
GPT2_124M_SOURCE = """\
import torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
gpt2 = GPT2LMHeadModel(GPT2Config(bos_token_id=0, eos_token_id=0))
ids = torch.randint(0, gpt2.config.vocab_size, (4, 128))

def gpt2_step():
    gpt2.zero_grad()
    gpt2(ids, labels=ids).loss.backward()
"""


def _run(source: str, name: str):
    ns: dict = {}
    exec(compile(source, f"<{name}>", "exec"), ns)
    return ns


def cnn_step():
    """(model, step) of the CNN with the reused pool."""
    ns = _run(CNN_SOURCE, "cnn")
    return ns["cnn"], ns["cnn_step"]


def hf_gpt2_step():
    """(model, step) of the tiny 12-block Hugging Face GPT-2."""
    ns = _run(GPT2_SOURCE, "gpt2")
    return ns["gpt2"], ns["gpt2_step"]
