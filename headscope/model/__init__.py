"""Everything that touches the model: loading and placement, the one attach point (capture), how a layer's
attention is read (readout, fused, the C++ kernel), masks, and which model a report was measured on.

Modules:
    architecture   What a model's config says of its shape
    batch          A batch as the model takes it: token ids padded into one tensor, the mask
    capture        The one way headscope touches a model
    gguf_cache     A GGUF file's model as transformers de-quantizes it, kept as a plain checkpoint folder
    identity       Which model a report was measured on, and whether a loaded model is that one
    layer_outputs  What a decoder layer returns (a tensor, or a tuple holding tensors and other things)
    layers         One description of a model's decoder layers (projections, norms, post-norms, residual scale)
    lm_head        The LM head a command wants: is it in the checkpoint, and does a device map place it?
    loading        Model and tokenizer from a hub id, a local folder or a .gguf file; device and dtype
    masks          Which keys each query row may see: the masks transformers builds, read and rebuilt block by block
    memory         How much fits: free device memory and per-token activation estimates
    norms          A norm as attribution reads it: frozen (a linear map), its Jacobian back and forward
    once           One model load at a time in this process, and within it each file parsed once
    placement      Where a model's weights go: the memory checks before loading, device maps (read, checked
    precision      Float32 products in float32: no TensorFloat-32 inside headscope's passes
    projection     The attention's output projection, and what it makes of each head's output
    turns          One headscope call on a model at a time: calls from several threads on one model take turns
    write_path     How each layer's attention output reaches the residual stream
    attention/     How a layer's attention is read
"""
