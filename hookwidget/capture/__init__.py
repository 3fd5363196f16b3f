"""Hooks while the user's code runs: the tracer (lifecycle, module hooks, steps), the recording its hooks fill
(recording.py: one per trace, one per step where the flight recorder cuts the tracer), the δ hook, what each call keeps,
the streamed per-sample norms, the watch's per-step statistics (step_stats.py, stat_rows.py, sample_stats.py,
compiled_stats.py: the keep strategy "stats"), where each call's samples are (samples.py, rows.py: proven, never taken
from a size), and the stand-in that sees every backward pass. Knows nothing of analysis or views.

Floor: above record/ and the bottom floor (layers/, stats, state, options, interventions); beside analysis/.
"""
