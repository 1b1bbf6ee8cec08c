"""The vocabulary every stage shares, in one place: pure functions and constants, no torch.

- :mod:`tdiff.vocab.paths`: module paths — the root label ``(model)``, the decoder-layer pattern,
  the decoder layer a path or a call lies in.
- :mod:`tdiff.vocab.kinds`: boundary kinds (``norm``, ``moe_combine``...) and how a module, a
  record or the code between two events is classified.
- :mod:`tdiff.vocab.boundaries`: canonical boundary names (``layers.3.mlp.down``, docs/BOUNDARIES.md)
  and their parser.
- :mod:`tdiff.vocab.nested`: the walk of nested values (tuples, lists, mappings, dataclasses) to
  their leaves, and the sub-names it gives them (``1.cos``, shown as ``module[1][cos]``).
- :mod:`tdiff.vocab.parse`: what users write in options — ranges, sizes, regular expressions.
"""
