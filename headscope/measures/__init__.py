"""Measurements that ride on a forward pass, peers behind `headscope.model.capture.Measure`.

statistics  every attention row -> per-(sentence, head) sums (entropy, locality, sink, ...)
example     every head's attention on one short sentence, for the example charts
"""
