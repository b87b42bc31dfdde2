"""What generated kernel modules import at run time (``templates/_common.j2``): the fast launch and
``autograd.Function`` entry (:mod:`.launch`), the ``torch.library`` doors for torch.compile
(:mod:`.custom_ops`), class-label checks (:mod:`.labels`), sharing one quantised input between sibling
kernels (:mod:`.share`), and the Triton interpreter's switch and fixes (:mod:`.interp`, run when
patchdsl is imported, before anything imports triton)."""
