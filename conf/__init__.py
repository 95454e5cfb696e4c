"""The Hydra configuration tree of predmask (installed as a package so every CLI finds it)."""
