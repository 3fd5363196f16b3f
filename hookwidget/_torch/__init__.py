"""The fence: every use of a name torch keeps private lives here, behind a small function with a test that fails
loudly when torch changes it (tests/test_torch_fence.py). Each module says which torch it was checked on and why
no public API does the job.

    modules.py   a module's own parameters, buffers and children; the module and optimizer hook registries;
                 a module's parameters swapped for a rerun of its forward
    autograd.py  the running backward node, sequence numbers, the functorch transform stack, what a node saved
    tensors.py   version counter, view base, tensor hook dicts, copy-on-write clones, sparse values, storage identity
    pytree.py    flattening nested arguments to tensors and back
    norms.py     the multi-tensor (foreach) kernels behind batched norms
    compile.py   torch.compile's wrapper module
    layers.py    private base classes and fields of torch's layers (convolutions, InstanceNorm, MultiheadAttention)
    amp.py       a GradScaler's current scale

Floor: the lowest. Imports torch and the standard library only.
"""
