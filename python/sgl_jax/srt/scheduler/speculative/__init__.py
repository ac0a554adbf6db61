"""Speculative decoding on the scheduler's side, gathered in one place: the per-rank `Speculator` (speculation.py:
draft, verify, accept; n-gram drafts), the draft models (draft_model.py: STANDALONE; eagle_draft.py: EAGLE and
EAGLE-3 heads, built by drafters.py), their runners over the model runner's programs (draft_runners.py) and the
step costs that decide when speculation pays (spec_costs.py). The JAX-free host structures they share (draft
trees, the n-gram cache) sit lower, in `sgl_jax.srt.speculative`; the EAGLE heads are model files
(models/llama_eagle.py, llama_eagle3.py). docs/architecture.md has the layering."""
