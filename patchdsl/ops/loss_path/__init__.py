"""The causal-LM loss path shared by ``fused_linear_cross_entropy``, ``fused_cross_entropy``,
``fused_linear_logprobs`` (its forward: :func:`make_logprobs_forward`) and ``fused_linear_jsd``
(its forward: :func:`make_jsd_forward`).

Both ops are selected on ``lm_head`` but act on the causal LM that owns it (the *host*: the
nearest ancestor with the ``CausalLM`` kind, the root ``""`` for Hugging Face models).

* ``fused_linear_cross_entropy`` replaces the host's ``forward`` (on the instance) with one that,
  when training with labels, calls ``self.model(...)`` with every argument the original forward
  passes, slices the hidden states by ``logits_to_keep`` as the original does, and computes the
  loss from the hidden states and ``lm_head``'s weight (read at call time) without materialising
  the logits.  It returns the original output class with ``loss`` set and ``logits=None``.  In
  eval mode, under ``no_grad``, or without labels it calls the original forward unchanged.
* ``fused_cross_entropy`` replaces only the loss function: Hugging Face's ``PreTrainedModel``
  has a ``loss_function`` property whose setter stores ``_loss_function`` on the instance, so the
  op sets that attribute (per instance, undone by the runtime).  Where a class has no such
  property, it patches the forward like the loss path above but computes the logits with
  ``self.lm_head`` (so they are returned) and the loss with the fused kernel.

Semantics follow ``transformers.loss.loss_utils.ForCausalLMLoss``: labels shifted left by one
with ``ignore_index`` padding at the end (or ``shift_labels`` used as given), fp32 loss math,
``sum / num_items_in_batch`` when that is given, else the mean over labels that are not ignored
(all ignored: NaN, as HF; ``num_items_in_batch=0``: inf/NaN, as HF), labels of a dtype torch's
cross_entropy refuses are refused, and a label out of bounds raises IndexError on the CPU and
trips a device-side assert on the GPU (``patchdsl/kernel_support/labels.py``).  One documented
difference: a call with ``shift_labels`` but no ``labels`` gets a loss (HF computes one only when
``labels`` is given).

What the forward does between the decoder body's last hidden state and the loss is read from its
source (:func:`head_transform`, :func:`_read_head`): slicing by ``logits_to_keep``, dtype casts, the lm_head call, and the
scalings of :data:`KNOWN_SCALARS` / :data:`KNOWN_SOFTCAPS` (Granite's ``logits_scaling``,
Cohere's ``logit_scale``, Falcon-H1's ``lm_head_multiplier``, MiniCPM3's hidden-state scaling,
Gemma's ``final_logit_softcapping``, ...) are reproduced by the fused loss; any other statement
that computes the logits, the hidden states they come from or the loss refuses the site, naming it.

The decoder body is the one the forward calls (:func:`~.source.body_path`): ``self.model``, the base
model under the class's ``base_model_prefix`` (``self.transformer``: GPT-2, Bloom, Falcon, MPT, CTRL ...;
``self.gpt_neox``) or its decoder (``self.model.decoder``: OPT), with the arguments it passes by
position (``self.transformer(input_ids, ...)``) passed the same way.  Keyword arguments of the loss call
that ForCausalLMLoss does not read (XGLM's ``pad_token_id=self.config.pad_token_id``) are allowed; the
router-logits flag is resolved as the forward resolves it (the call's, else the config's, and-ed with
config flags: Doge's ``and self.config.is_moe``), with or without a router aux loss after it.  An lm_head
that is not a linear layer (BERT-style heads with a transform before the vocabulary projection) is
refused with its structure (:func:`~.planning.head_module_reason`).

What a host must look like (checked, one-line refusal otherwise): ``self.model`` (or the above), a plain
``nn.Linear`` ``lm_head`` (PEFT's ModulesToSaveWrapper is unwrapped; a LoRA-wrapped lm_head is
refused because its delta lives in its forward), the standard ``ForCausalLMLoss``, and a forward
whose source calls ``self.lm_head(`` and ``self.loss_function(``, passes its own arguments through
to ``self.model`` by name, and reads nothing else from ``self`` or ``self.config`` than what the
fused loss reproduces (vocab_size and the scalings of :data:`KNOWN_SCALARS` / :data:`KNOWN_SOFTCAPS`).

A vision-language model's ``...ForConditionalGeneration`` is such a host too: its forward may read
the language tower's config (:data:`~.source.TEXT_CONFIG_READS`: ``text_config.vocab_size``, checked
against lm_head's outputs, and the softcap / scaling there) and pass its body ``labels=labels``
(Gemma 3, PaliGemma) and ``return_dict=True``, which the fused forwards pass the same way.
"""

from __future__ import annotations

# one module per concern (planning -> sharding -> labels_loss -> logprobs / jsd; what the host's forward
# does is read by patchdsl.model.forward.causal_lm); the names below are the package's API, imported as
# patchdsl.ops.loss_path.<name> by the ops
from .planning import (  # noqa: F401
    causal_lm_host, head_module_reason, hidden_of, lm_head_misfit, vocab_of,
)
from .sharding import (  # noqa: F401
    call_as_forward, head_gather, unsharded_reason,
)
from .labels_loss import (  # noqa: F401
    head_logits, install_forward, make_forward, make_loss_function, original_forward, shift_labels_of,
    slice_hidden,
)
from .logprobs import (  # noqa: F401
    FUSED_FIELDS, fused_output_cls, make_logprobs_forward,
)
from .jsd import (  # noqa: F401
    JSD_KWARGS, make_jsd_forward, reference_jsd,
)
