"""Import torchvision and timm beside the CPU build of torch (issue 14).

PyPI's torchvision wheels for Linux are CUDA builds: their compiled extension (torchvision/_C.so) links
libtorch_cuda and does not load beside torch 2.13.0+cpu, so `import torchvision` stops at
`operator torchvision::nms does not exist` (torchvision registers fake kernels for nms and qnms at import,
whether or not its extension loaded). Its Python code (models, transforms) needs nothing from the
extension: the extension holds only the detection ops (nms, roi_align, deform_conv2d, ...), which no
classification model calls. So `import_torchvision()` defines the schemas of the two ops the import needs
(schemas only, no kernel: calling them raises) and imports it.

scripts/install.sh puts torchvision and timm in `<venv>/vision-packages`, outside site-packages, so that
nothing else finds a torchvision that cannot import by itself (transformers imports torchvision when it
sees one, and then fails); this module adds that folder to sys.path. A torchvision that imports by itself
(a CPU build, or CUDA torch) is used as it is: no schema is defined then.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

# The ops `import torchvision` needs to exist when its extension did not load (fake kernels are registered
# for them unconditionally), with their schemas as torchvision's csrc/ops defines them.
SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
EXTRA_PATH = Path(sys.prefix) / "vision-packages"

_library = None  # the torch.library.Library holding the schemas: its definitions live as long as it does


def _add_path() -> None:
    if EXTRA_PATH.is_dir() and str(EXTRA_PATH) not in sys.path:
        sys.path.append(str(EXTRA_PATH))  # appended: a torchvision in site-packages comes first
        importlib.invalidate_caches()


def _define_missing_schemas() -> list:
    global _library
    import torch

    defined = []
    for name, schema in SCHEMAS.items():
        try:
            torch._C._get_schema(f"torchvision::{name}", "")
            continue  # already there (the extension loaded, or defined before)
        except RuntimeError:
            pass
        if _library is None:
            _library = torch.library.Library("torchvision", "FRAGMENT")
        _library.define(schema)
        defined.append(name)
    return defined


def _forget_torchvision() -> None:
    for mod in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[mod]


def import_torchvision():
    """torchvision, importable beside a CPU torch. ImportError (one line) when it is not installed."""
    if "torchvision" in sys.modules and hasattr(sys.modules["torchvision"], "models"):
        return sys.modules["torchvision"]
    _add_path()
    if importlib.util.find_spec("torchvision") is None:
        raise ImportError(f"torchvision is not installed (scripts/install.sh puts it in {EXTRA_PATH})")
    try:
        return importlib.import_module("torchvision")
    except RuntimeError as e:
        if "torchvision::" not in str(e):
            raise
        _forget_torchvision()  # the failed import left a half-initialised package behind
    _define_missing_schemas()
    return importlib.import_module("torchvision")


def import_timm():
    """timm (which imports torchvision): ImportError (one line) when either is not installed."""
    import_torchvision()
    if importlib.util.find_spec("timm") is None:
        raise ImportError(f"timm is not installed (scripts/install.sh puts it in {EXTRA_PATH})")
    return importlib.import_module("timm")
