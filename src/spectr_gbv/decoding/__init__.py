"""Decoding: the warp shared by drafter and target (sampling), model loading (models; the real models' chunk packages
in gguf_packages, tiny random models in tiny, replacement linear layers in linear), the per-row KV cache (cache), the
K drafts as one token tree (draft_tree) and the speculative engine over B prompts (engine)."""
