"""Names of what a trace saw: qualified module and parameter names, and the include/exclude filter."""

from __future__ import annotations

import fnmatch

from hookwidget._torch.modules import own_parameters


def qualified_names(recorded: list, targets, target_names) -> tuple[dict, dict]:
    """Module -> qualified name, and qualified parameter name -> parameter.

    The roots are the given modules, or else the called modules no other called module
    contains. The largest root's submodules get their plain qualified names ("fc1"); other
    roots' get a prefix; a root itself is named by its variable name or class name."""
    walks: dict = {}  # id(root) -> list(root.named_modules()): each root walked once
    if targets is None:
        # An outer module is usually called (recorded) before its submodules: walk only the
        # submodules of modules not yet covered, then drop roots a later root contains.
        roots, inner = [], set()
        for m in recorded:
            if id(m) not in inner:
                roots.append(m)
                walk = walks[id(m)] = list(m.named_modules())
                inner.update(id(c) for _, c in walk[1:])
        roots = [m for m in roots if id(m) not in inner]
        target_names = None
    else:
        roots = list(targets)
    if not roots:
        return {}, {}
    for root in roots:
        if id(root) not in walks:
            walks[id(root)] = list(root.named_modules())
    primary = roots[0] if len(roots) == 1 else max(roots, key=lambda m: len(walks[id(m)]))
    names, params, used = {}, {}, set()
    for i, root in enumerate(roots):
        label = target_names[i] if target_names else type(root).__name__
        while label in used:
            label += "'"
        used.add(label)
        prefix = "" if root is primary else label + "."
        seen = set()  # as named_parameters(): a parameter shared by two modules of one root under its first name
        for qn, m in walks[id(root)]:  # one walk for modules and their parameters
            names.setdefault(m, prefix + qn if qn else label)
            pre = prefix + qn + "." if qn else prefix
            for pn, p in own_parameters(m).items():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    params.setdefault(pre + pn, p)
    return names, params


def name_filter(include, exclude):
    inc = [include] if isinstance(include, str) else list(include or [])
    exc = [exclude] if isinstance(exclude, str) else list(exclude or [])
    if not inc and not exc:
        return _keep_all

    def keep(name: str) -> bool:
        if inc and not any(fnmatch.fnmatchcase(name, p) for p in inc):
            return False
        return not any(fnmatch.fnmatchcase(name, p) for p in exc)

    return keep


def _keep_all(name: str) -> bool:
    return True
