"""A character-level GPT trained under low-precision recipes with lpsim: the corpus, the model,
the recipes and the trainer (python -m experiments.gpt.train)."""
