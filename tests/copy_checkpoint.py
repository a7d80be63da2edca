"""A tiny checkpoint whose greedy output continues counting: after token t it mostly says t + 1.

Built from a random ``llama`` checkpoint (tests/checkpoints.py): ``lm_head`` row ``t + 1`` is the
normalized embedding of ``t``, so the logit of ``t + 1`` at a token ``t`` is the embedding's norm
(~sqrt(hidden)) while every other logit is a random inner product (~N(0, 1) per unit norm). The
attention and MLP outputs are scaled by ``mix``: 0 makes the model a pure bigram (the output
provably counts up from the prompt's last token), a larger ``mix`` lets the context move the
argmax at some positions, so the output depends on the K/V of every earlier token and a wrong
K/V (a rejected draft left behind) changes it. A prompt that counts ``10 11 12 ...`` and ends
with ``5 6 7`` makes n-gram drafts (from the prompt) right most of the time.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import make_checkpoint


def make_counting_checkpoint(folder: Path | str, mix: float, seed: int = 0) -> Path:
    folder = make_checkpoint("llama", folder, seed=seed, max_position_embeddings=512)
    path = folder / "model.safetensors"
    weights = load_file(path)
    embed = weights["model.embed_tokens.weight"]
    unit = embed / embed.norm(dim=-1, keepdim=True)
    head = torch.zeros_like(embed)
    head[1:] = unit[:-1] * embed.shape[-1] ** 0.5  # row t + 1 <- token t
    head[0] = unit[-1] * embed.shape[-1] ** 0.5
    weights["lm_head.weight"] = head
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * mix
    save_file(weights, path, metadata={"format": "pt"})
    return folder
