"""predmask.rl: the CPU-scale GRPO engine (tiny Qwen3 policy, synthetic verifiable arithmetic, emulated precision)."""
