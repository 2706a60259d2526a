"""Measurements that ride on a forward pass, peers behind `headscope.model.capture.Measure`.

Modules:
    detectors       Detectors a researcher defines
    exemplars       Exemplars: the corpus rows where each head does its thing most, streamed
    heads           Whole attention matrices of chosen heads on one text
    ov_circuits     Every head's OV circuit on tokens, read from the weights with the norms' gains folded in
    ov_copying      What a head's weights copy, with no data: the OV copying score of Elhage et al. 2021
    pattern_scores  The detectors' measure: rides on the capture and keeps, per (sentence, layer, head, detector)
    probes          The probe battery: repeated random tokens
    retrieval       The retrieval probe (Wu et al. 2024): a random span planted early in a long sequence, repeated
    row_sums        Every attention row reduced to per-(sentence, head) sums
    rows            Parts of a block of attention rows the row sums share
    statistics      The corpus statistics measure: rides on the capture
    writes          What each head writes into the residual stream, and what its sink reads
"""
