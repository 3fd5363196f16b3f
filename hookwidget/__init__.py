"""hookwidget: see what PyTorch's hooks see, where gradients go, and what changes when you change them."""

__version__ = "0.1.0"
