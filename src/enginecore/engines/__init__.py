"""Engines for real models, each behind its own optional extra.

- :mod:`enginecore.engines.transformers`: ``TransformersEngine``, a continuous-batching engine
  for a local causal LM checkpoint (``pip install 'enginecore[transformers]'``).

Importing this package imports nothing heavy; each engine module imports its own framework.
"""
