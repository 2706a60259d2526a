"""Everything that touches the model: loading and placement, the one attach point (capture), how a layer's
attention is read (readout, fused, the C++ kernel), masks, and which model a report was measured on."""
