"""_torch/patch.py: one stand-in per attribute while anyone listens, restored when the last one leaves,
in whatever order they leave, and never over someone else's later patch. Checked on a stand-alone owner
(a class made here) and on the two real patches: torch.autograd.backward/.grad and GradScaler.scale."""

import threading
import types

import torch
from torch import nn

import hookwidget as hw
from hookwidget._torch.patch import Patch
from hookwidget.capture import backward as autograd_calls


def original(x):
    return x + 1


def make_owner():
    return types.SimpleNamespace(f=original)


def counting(name, orig, listening):
    def stand_in(x):
        for ls in listening():
            ls.append(x)
        return orig(x)

    stand_in.__wrapped__ = orig
    return stand_in


def test_installed_on_the_first_listener_removed_with_the_last():
    owner = make_owner()
    p = Patch(owner, ("f",), counting)
    assert owner.f is original and not p.installed("f")
    a = []
    p.listen(a)
    assert owner.f is not original and p.installed("f")
    assert owner.f(1) == 2 and a == [1]
    p.unlisten(a)
    assert owner.f is original and p.listeners == ()
    assert owner.f(5) == 6 and a == [1]  # not heard once it left


def test_nested_listeners_share_one_stand_in_and_hear_each_call_once():
    owner = make_owner()
    p = Patch(owner, ("f",), counting)
    a, b = [], []
    p.listen(a)
    stand_in = owner.f
    p.listen(b)
    assert owner.f is stand_in  # not wrapped twice
    owner.f(3)
    assert a == [3] and b == [3]
    p.unlisten(b)
    assert owner.f is stand_in
    p.unlisten(a)
    assert owner.f is original
    p.listen(a)
    assert owner.f is stand_in  # made once per (name, original), reused
    p.unlisten(a)


def test_out_of_order_end_and_refcounts():
    owner = make_owner()
    p = Patch(owner, ("f",), counting)
    a, b = [], []
    p.listen(a)
    p.listen(b)
    p.listen(a)  # twice: counted twice
    p.unlisten(a)  # the first to come leaves first
    assert p.installed("f")
    p.unlisten(a)
    assert p.installed("f") and p.listeners == (b,)
    p.unlisten(a)  # not listening any more: nothing
    assert p.installed("f")
    p.unlisten(b)
    assert owner.f is original


def test_someone_elses_later_patch_is_left_alone():
    owner = make_owner()
    p = Patch(owner, ("f",), counting)
    a = []
    p.listen(a)
    ours = owner.f

    def theirs(x):
        return ours(x) * 10

    owner.f = theirs
    p.unlisten(a)
    assert owner.f is theirs  # not undone
    assert owner.f(1) == 20 and a == []  # ours below theirs only passes the call on
    p.listen(a)  # installed over theirs, which still calls our first stand-in: heard once, not twice
    assert owner.f(1) == 20 and a == [1]
    p.unlisten(a)
    assert owner.f is theirs
    owner.f = ours  # they restore what they saw: our stand-in, now listened to by nobody
    assert owner.f(2) == 3 and a == [1]
    a.clear()
    p.listen(a)  # installing again does not wrap our own stand-in
    assert owner.f(2) == 3 and a == [2]
    p.unlisten(a)
    assert owner.f is original


def test_several_attributes_and_a_class_owner():
    class Owner:
        def f(self, x):
            return x

        def g(self, x):
            return -x

    f, g = Owner.f, Owner.g

    def make(name, orig, listening):
        def stand_in(self, x):
            for ls in listening():
                ls.append((name, x))
            return orig(self, x)

        return stand_in

    p = Patch(Owner, ("f", "g"), make)
    seen = []
    p.listen(seen)
    assert Owner().f(1) == 1 and Owner().g(2) == -2 and seen == [("f", 1), ("g", 2)]
    p.unlisten(seen)
    assert Owner.f is f and Owner.g is g


def test_threads_listen_and_leave_at_once():
    owner = make_owner()
    p = Patch(owner, ("f",), counting)
    barrier = threading.Barrier(8)

    def run():
        mine = []
        barrier.wait()
        for _ in range(200):
            p.listen(mine)
            owner.f(0)
            p.unlisten(mine)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert owner.f is original and p.listeners == ()


def test_autograd_backward_and_grad_restored_after_traces_and_watches():
    backward, grad = torch.autograd.backward, torch.autograd.grad
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with hw.watch(model, flight_recorder=False):
        assert autograd_calls._PATCH.installed("backward") and autograd_calls._PATCH.installed("grad")
        t = hw.trace(lambda: model(x).sum().backward())  # a trace inside a watch: one stand-in for both
        assert autograd_calls._PATCH.installed("backward")
        model(x).sum().backward()
    assert torch.autograd.backward is backward and torch.autograd.grad is grad
    assert len(t.steps) == 1


def test_grad_scaler_scale_restored_and_someone_elses_patch_kept():
    scale = torch.amp.GradScaler.scale
    model = nn.Linear(3, 2)
    w = hw.watch(model, flight_recorder=False)
    ours = torch.amp.GradScaler.scale
    assert ours is not scale

    def theirs(self, outputs):
        return ours(self, outputs)

    torch.amp.GradScaler.scale = theirs
    try:
        w.close()
        assert torch.amp.GradScaler.scale is theirs
    finally:
        torch.amp.GradScaler.scale = scale
