"""The watch view's anomaly list names the samples that carried each anomalous step (per_sample=True, issue 43),
on a standalone page (w.to_html) at 1100 and 1500 px: the kernel's text, set as text."""

import pytest

pytestmark = pytest.mark.browser


def test_anomaly_list_names_the_planted_sample(page, img_dir, tmp_path):
    import torch
    import torch.nn.functional as F
    from torch import nn

    import hookwidget as hw

    torch.manual_seed(0)
    V, T, k = 12, 8, 60
    model = nn.Sequential(nn.Embedding(V, 16), nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, V))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    with hw.watch(model, per_sample=True, window=10) as w:
        for step in range(k + 1):
            ids = torch.randint(0, V, (6, T))
            labels = (ids + 1) % V
            if step == k:
                labels[3, [2, 5]] = (labels[3, [2, 5]] + 6) % V  # sample 3: two labels that follow no rule
            opt.zero_grad()
            F.cross_entropy(model(ids).reshape(-1, V), labels.reshape(-1)).backward()
            opt.step()
    carried = next(a for a in w.anomalies if a.step == k).samples
    assert carried.samples[0][0] == 3
    path = w.to_html(tmp_path / "watch.html")
    for width in (1100, 1500):
        page.set_viewport_size({"width": width, "height": 900})
        page.goto(path.as_uri())
        page.wait_for_selector("body[data-ready='1']")
        shown = page.locator('[data-testid="watch-anomaly-samples"]')
        assert shown.count() == 1  # one anomalous step: its samples once, beside its first anomaly
        assert shown.inner_text().strip() == f"· {carried.text}"
        box, list_box = shown.bounding_box(), page.locator(".hw-w-anoms").bounding_box()
        assert box["x"] + box["width"] <= list_box["x"] + list_box["width"] + 1  # wrapped inside the list
        page.locator('[data-testid="watch"]').screenshot(path=str(img_dir / f"watch_samples_{width}.png"))
    assert not page.errors, page.errors
