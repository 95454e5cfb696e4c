"""The VeRL plugin: predmask's methods as verl 0.9.1 policy losses, with vLLM's top-K log-probs carried to the actor.

Importing this package (or any module of it but :mod:`predmask.verl.plugin`) installs nothing. Its modules, in
the order data flows through them, are described in docs/verl-plugin.md.
"""
