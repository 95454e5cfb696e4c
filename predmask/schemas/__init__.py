"""predmask.schemas: the structured-config schemas of conf/ as dataclasses, below both the config layer and the engines.

Stdlib and omegaconf only, so composing imports no torch; nothing here imports the config layer or an engine.
"""
