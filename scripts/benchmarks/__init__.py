"""The performance report's sections, one module each, over one harness.

``harness`` holds what every section shares (the figure, paired rounds and
their ratios, sides taking turns, the report); ``workloads``, ``processes``
and ``pgserver`` hold the measurements more than one section runs; each
other module is one section, and ``sections`` lists them. ``scripts/bench.py``
is the command line.
"""
