"""IteraGPU Lab: GPU memory and time per phase, and the cost of one accepted result."""
