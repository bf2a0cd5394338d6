"""The routed experts of an MoE layer on NVIDIA GPUs: routing (``route``), the expert
permutation (``align``), the grouped FP4-expert GEMMs of three kernel families (``stream``,
``split``, ``bf16``), the Triton helpers they share (``common``) and the op that picks a family
and its tiles (``experts``). The backend imports every module here when it loads its ops."""
