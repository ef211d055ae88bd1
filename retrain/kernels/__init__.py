"""Torch kernels shared by the trainer (retrain/backends/local.py) and the in-process
sampler (retrain/engines/pytorch.py): bf16 linears in fixed row tiles (precision.py),
chosen-token logprobs from the split-off output layer (logprobs.py), packed
micro-batches (packing.py) and FlexAttention for their rows on CUDA (flex.py). They sit below both, so neither imports the other."""
