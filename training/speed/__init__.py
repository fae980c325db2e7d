"""Everything that makes a step faster (levers, native kernels, bf16 master weights, the MFU measure).
Imports runtime only; the jobs call speedup.apply once, on their loaded model."""
