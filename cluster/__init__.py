"""Ray actors around the workers, placement, the router, handoff, failure handling, the command line.

The only package that imports `ray`.
"""
