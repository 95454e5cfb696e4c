"""predmask.schemas: the structured-config schemas of conf/ as dataclasses, below both the config layer and the engines.

Modules: ``unknown_keys`` (the one unknown-key check of every section), ``train_schema`` (conf/train.yaml's
``base``, ``rollout`` and ``trainer`` sections and the tracker names ``trainer.logger`` takes), ``task_schema``
(the arithmetic task's ``TaskConfig``), ``variational_schema`` (the variational family's sections) and
``cluster_schema`` (clusters and cluster models). ``predmask.config`` stores them in Hydra's ConfigStore; the
engines build them from a run's resolved config. Stdlib and omegaconf only, so composing imports no torch, and
nothing here imports the config layer or an engine.
"""
