import hookwidget


def test_version_is_declared():
    assert hookwidget.__version__.count(".") == 2
