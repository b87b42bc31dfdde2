"""What a model's forwards do, read from their source and probed on CPU stand-ins: the rotary layouts
and attention facts (:mod:`.rotary`), and what a causal LM's forward does between its decoder body and
its loss (:mod:`.causal_lm`, with the logit scalings of :mod:`.logits`)."""
