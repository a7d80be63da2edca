"""Logits -> tokens: the per-step sampling metadata, the sampler, logits processors, beam-search
steps, and the rule that decides which sampled tokens a step keeps (``sampling_step``)."""
