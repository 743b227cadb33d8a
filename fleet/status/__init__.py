"""``fab status``: what a run is doing, from its events, its log and its process.

- ``model``: the facts and texts -> one frozen ``RunStatus`` (pure; states, transitions, exit codes);
- ``diagnose``: known failure signatures in a log -> cause and fix (pure);
- ``fetch``: the inputs from a target in one command, or from a local run dir (``--log``);
- ``render``: the picture, the all-targets table, JSON, ``--watch``.

The task (``tasks.status``) opens the targets, fans out with ``fleet.cli.map_targets``, and joins
fetch to render; the model imports neither.
"""
