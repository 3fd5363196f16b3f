"""Questions on a finished record, with no hooks: facts (one cache per trace), batches (which rows are samples),
per-sample gradients and norms, the generic rule's rows (a typed Refusal where there are none), coverage (the notes
on what factor queries leave out), health, diff.

Floor: above record/ and the bottom floor; beside capture/ (neither imports the other).
"""
