"""Partial-tail reuse: the last, partial block of a finished sequence is kept, not recomputed.

Only full blocks carry a chained hash (``hashing``), so without tails a request that resends a
finished sequence's tokens (the next turn of a chat, a Responses continuation) recomputes up to
``block_size - 1`` of them. The design chosen here is copy-on-reuse:

* **Kept on free.** When a sequence finishes, the block holding its computed tokens past the
  last full block (``num_computed_tokens % block_size`` of them, > 0) becomes a *tail* if the
  sequence held it alone: it keeps its K/V and joins the evictable LRU of the ``BlockPool``,
  under ``tail_key(hash of the last full block before it, extra_keys)`` with its token ids.
  Only computed tokens count: the last sampled token (never fed to the model) and rejected
  drafts (past ``num_computed_tokens``) are not in it. Tails are only made after a successful
  forward (a finished or aborted sequence), never by a preemption or a failed step.
* **Reused by copy.** A lookup that ends after ``k`` full blocks looks for the tail under the
  ``k``-th block's key whose tokens share the longest prefix with the rest of the prompt (capped
  so that one prompt token is still computed). Admission allocates a fresh block as usual and
  asks the model runner to copy the tail into it (the ``block_copies`` of copy-on-write), so
  those tokens count as computed. The tail itself is never written: any number of requests
  may copy it, and it is pinned (a reference, not a table entry) until the step that copies it
  ends, so no allocation in the same step can evict and overwrite it before the copy ran. When
  the pin would cost the last block an admission needs, the tail is taken instead: it becomes
  the sequence's block as it is (no copy) and stops being a tail.
* **Bounded.** A tail is one block of the pool on the same LRU as cached full blocks: it never
  makes an allocation fail (not even the admission that reuses it), and it is evicted before
  its own chain's full blocks (a sequence frees its table tail first). The tails under one key
  form an antichain: a tail that only repeats the start of another is not kept; one that
  extends others replaces them.

Why not share the block in place (a pinned tail written by its next user)? Positions past the
tail would be written while other requests may still want the shorter tail, which needs the
same copy-on-write anyway, plus a block that is at once a tail, a table entry and later a full
hashed block. One block copy per reuse (one block's K/V over all layers: 2 MiB for an 8B Llama
at block size 16 in bfloat16) is cheap next to the forward it saves a part of.

With prefix caching off there are no tails. ``prompt_logprobs`` requests look up nothing; beam
groups look up full blocks only (a beam readmitted in lockstep may run no token in its first
step, so a copy for it would not run with that step).
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixserve.kv.hashing import BlockHash, ExtraKeys, hash_block_tokens


def tail_key(parent_hash: BlockHash | None, extra_keys: ExtraKeys) -> BlockHash:
    """The key of a tail after the full block hashed ``parent_hash`` (None: the first block).

    A parent hash already chains ``extra_keys``; a tail in the first block has none, so its key
    is the hash of an empty block under the extra keys (no full block hashes to it: a full block
    packs ``block_size`` tokens, so the hashed bytes differ).
    """
    if parent_hash is not None:
        return parent_hash
    return hash_block_tokens(None, (), extra_keys)


def common_prefix_len(a: Sequence[int] | None, b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (0 if ``a`` is None)."""
    n = 0
    for x, y in zip(a or (), b):
        if x != y:
            break
        n += 1
    return n
