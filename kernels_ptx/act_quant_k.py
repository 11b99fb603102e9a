"""act_quant_k.ptx: activations rounded to Q8_K per 256-block as the CPU's K-quant products round them."""

PARAMS = {}
