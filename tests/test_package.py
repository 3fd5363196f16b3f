import hookwidget


def test_version_is_declared():
    assert hookwidget.__version__.count(".") == 2


def test_a_trace_displays_as_text_where_widgets_do_not_render():
    import torch
    from torch import nn

    import hookwidget as hw

    m = nn.Linear(2, 3)
    t = hw.trace(lambda: m(torch.randn(4, 2)).sum().backward())
    bundle = t._repr_mimebundle_()
    data = bundle[0] if isinstance(bundle, tuple) else bundle
    assert data["text/plain"].startswith("Trace: 1 layers")
    assert "a=(4, 2) δ=(4, 3)" in data["text/plain"]
