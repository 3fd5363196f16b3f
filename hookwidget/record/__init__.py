"""What ran, as plain data: module calls, backward steps, the grad_fn graph walk and its networkx build, layer
naming, the notes catalogue (notes: Note(id, fields) and its one text). Capture fills the raw Records (calls);
assemble turns them into the immutable RunRecord a Trace holds (run), once, when the run ends; nothing reads a
record back into hooks.

Floor: above layers/, stats, state, options, interventions; below capture/ and analysis/.
"""
