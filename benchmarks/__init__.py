"""Benchmarks: hookwidget's cost against plain forward+backward and against torch.func, Opacus,
BackPACK and TorchLens, all variants of one model interleaved in one process. `python -m benchmarks`."""
