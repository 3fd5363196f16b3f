"""Context managers that undo one change each, so one ExitStack can own every hook of a trace."""


class Removing:
    """Context manager that removes a hook handle on exit."""

    def __init__(self, handle):
        self.handle = handle

    def __enter__(self):
        return self.handle

    def __exit__(self, *exc):
        self.handle.remove()


class Restoring:
    """Context manager that puts a module attribute back as it was on entry."""

    def __init__(self, owner, name: str):
        self.owner, self.name = owner, name

    def __enter__(self):
        self.original = getattr(self.owner, self.name)

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.original)


class Patched:
    """Context manager that replaces a module attribute and puts the original back on exit."""

    def __init__(self, owner, name: str, value):
        self.owner, self.name, self.value = owner, name, value

    def __enter__(self):
        self.original = getattr(self.owner, self.name)
        setattr(self.owner, self.name, self.value)

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.original)
