"""hyflow: reinforcement-learning post-training for large language models.

One driver process owns the dataflow (generate -> reward -> log-probs -> advantages -> update); workers own
the models. The same code runs in one plain Python process or on a Ray cluster. See DESIGN.md for the map.
"""

__version__ = "0.1.0"
