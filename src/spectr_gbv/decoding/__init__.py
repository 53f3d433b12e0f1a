"""Decoding: the warp shared by drafter and target (sampling), model loading (models), the per-row KV cache
(cache), the K drafts as one token tree (draft_tree) and the speculative engine over B prompts (engine)."""
