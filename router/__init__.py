"""mlx-router: the HTTP front end. Never imports mlx or mlx_lm.

By role: ``http`` (the APIs and their output), ``chat`` (template, tokenizer, plan, tools,
constraints, sampling parameters), ``fleet`` (models, workers, dispatch, admission, the
queue), ``ops`` (status, access, console, service); ``app`` wires them, ``job`` is the one
type they share. chat and fleet never import each other: they meet in ``http/api.py``.
"""
