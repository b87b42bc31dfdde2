"""Training a patched model: the Trainer / TRL integration (:mod:`.trainer`, its arguments :mod:`.args`),
the post-training losses on the fused log-probs (:mod:`.posttrain`), a whole training step captured as one
CUDA graph (:mod:`.graphs`: the step, its capture and replay; :mod:`.graph_checks`: what may be captured,
decided before; :mod:`.eager_mask`: transformers' mask decisions made as in an eager step, here and
under torch.compile), and torch.compile of patched models (:mod:`.compile`).  Only
:mod:`patchdsl.runtime` mutates a model; this package calls it."""
