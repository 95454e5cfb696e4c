"""The VeRL plugin: predmask's methods as verl 0.9.1 policy losses, with vLLM's top-K log-probs carried to the actor.

Importing this package (or any module below but :mod:`predmask.verl.plugin`) installs nothing. The modules, in the
order data flows through them:

- :mod:`predmask.verl.overrides` -- a composed predmask run config -> verl Hydra overrides (pure; no verl);
- :mod:`predmask.verl.launch` -- ``python -m predmask.verl.launch``: verl's trainer with the plugin in every process;
- :mod:`predmask.verl.plugin` -- the module verl imports in every process (``VERL_USE_EXTERNAL_MODULES``);
  importing it installs the hooks below, each when its verl module is imported (:mod:`predmask.verl._hooks`);
- :mod:`predmask.verl.rollout_hook` -- hook on vLLM's server: the rollout returns the top-K log-probs;
- :mod:`predmask.verl.records` -- vLLM's log-probs -> one ``TopKRecord`` per sample (pure; no verl);
- :mod:`predmask.verl.packing` -- records -> response-aligned support -> verl's packed rows (pure; no verl);
- :mod:`predmask.verl.gather` -- training log-probs on the support, full or vocab-sharded logits (pure torch);
- :mod:`predmask.verl.worker` -- hook on verl's actor worker: the top-K-aware TrainingWorker;
- :mod:`predmask.verl.topk_loss` -- the loss verl's engines call: logits processor, then verl's ``ppo_loss``;
- :mod:`predmask.verl.loss` -- every predmask method registered as a verl policy loss (``predmask.policy_loss``);
- :mod:`predmask.verl.reward` -- verl's reward scoring of a response (data preparation's check).

See docs/verl-plugin.md.
"""
