"""What a person sees: the explorer's payload, the widget, the watch's widget, standalone pages, TensorBoard.
Reads the Trace and the watch through their public methods; nothing below imports it.

Floor: above analysis/ and capture/; below trace (which imports it lazily, to display itself).
"""
