"""How a layer's attention is read: the probabilities the model's own eager function returns (`readout`), or, for
long rows, one fused pass over tiles of keys (`tile_loop`) whose per-row state `finish_rows` turns into the rows'
values (the `RowValues` contract every path returns), run by headscope's C++ kernel on the CPU (`cpu_kernel`,
source in kernels/) or its Triton kernel on CUDA (`cuda_kernel`); `dispatch` decides which, per layer, and drops a
kernel that fails or disagrees on its first call.

Modules:
    cpu_kernel    headscope's C++ kernel on CPU (kernels/row_state.cpp), built on first use
    cuda_kernel   headscope's Triton kernel for the fused pass on CUDA
    dispatch      Which of headscope's kernels computes a capture's attention, and when (TileKernel)
    finish_rows   A block of query rows' output and statistics from the fused pass's folded state (attention.tile_loop)
    key_patterns  Patterns of target keys the fused pass reads in the same pass as the statistics
    readout       How one layer's attention probabilities are read, and its output computed
    tile_loop     A layer's attention output and every per-row statistic in one pass over tiles of keys
"""
