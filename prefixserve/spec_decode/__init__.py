"""Speculative decoding without a draft model: drafts from text the engine has already seen,
verified by the target model in the step's one forward (``config.py`` has the options)."""
