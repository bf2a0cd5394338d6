"""FP8 block-scaled GEMM and ``linear`` on NVIDIA GPUs: the registered ops and the plan that
picks a kernel per product (``ops``), the tile kernels (``tiles``), the decode-sized streaming
kernels (``stream``), the bf16 route for 32-column scale blocks (``bf16``), cuBLAS's blockwise
FP8 GEMM (``cublas``) and the fp32 x bf16 product of the LM head and router (``dense``)."""
