"""CPU test doubles of GPU behaviour: what a CUDA device does differently from the CPU device the suite runs on."""
