"""What ran, as plain data: module calls, backward steps, the grad_fn graph walk and its networkx build, layer
naming. Only capture builds a record; nothing reads it back into hooks.

Floor: above layers/, stats, state, options, interventions; below capture/ and analysis/.
"""
