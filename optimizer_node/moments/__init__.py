"""How a node stores the optimizer's moments: fp32 as torch does, bf16, or 8 bits per value
(blockwise, an absmax scale per block, the dynamic map). The fp32 master parameters are exact in
every format; only the moments are rounded, once per step, after the update used them in fp32."""
