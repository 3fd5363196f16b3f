"""What a person sees: the explorer's payload (payload/, one module a job), the widget, the watch's widget,
standalone pages, TensorBoard and W&B, the watch's log_dir shards. What travels to the front-end and back
is written down once, in payload_schema.json, which the Python and the JS tests both check.
Reads the Trace and the watch through their public methods; nothing below imports it.

Floor: above analysis/ and capture/; below trace (which imports it lazily, to display itself).
"""
