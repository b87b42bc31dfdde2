"""Interoperability: other tools' configurations as specs -- a Liger-Kernel config (:mod:`.liger`) and a
transformers ``KernelConfig`` mapping of Hub kernels (:mod:`.translate`)."""
