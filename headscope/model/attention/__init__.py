"""How a layer's attention is read: the probabilities the model's own eager function returns (`readout`), or, for
long rows, one fused pass over tiles of keys (`tile_loop`) whose per-row state `finish_rows` turns into the rows'
values (the `RowValues` contract every path returns), run by headscope's C++ kernel on the CPU (`cpu_kernel`,
source in kernels/) or its Triton kernel on CUDA (`cuda_kernel`); `dispatch` decides which, per layer, and drops a
kernel that fails or disagrees on its first call."""
