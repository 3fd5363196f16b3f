"""The fence: every use of a name torch keeps private lives here, behind a small function with a test that fails
loudly when torch changes it (tests/test_torch_fence.py).

Floor: the lowest. Imports torch only.
"""
