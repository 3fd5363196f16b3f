"""Hooks while the user's code runs: the tracer (lifecycle, module hooks, steps), the δ hook, what each call keeps,
the streamed per-sample norms, folds of samples into rows, and the stand-in that sees every backward pass.
Knows nothing of analysis or views.

Floor: above record/ and the bottom floor (layers/, stats, state, options, interventions); beside analysis/.
"""
