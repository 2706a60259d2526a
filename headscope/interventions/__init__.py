"""Heads changed on purpose: how a head is removed (or windowed), the loss with heads removed, importance, ablate,
prune and its search, the KV-cache policy of windowed heads, surgery on the weights, activation patching (patch),
edges between components (circuit) and why a head attends (inspect --why).

Modules:
    clean_prefix   The clean model's decoder layers below every head a search can remove, run once for the whole search
    copying_cache  analyze's ov_copying column: every head's OV copying score, cached per model
    dormant        The dormant label, checked by removal
    edge_graph     The graph `circuit` scores and the maths of its circuits (docs/circuit.md has the definitions)
    edge_layers    Each decoder layer's pieces as `circuit` reads them (model/layers.py), each head's writes
    edge_patching  The exact patched passes of `circuit` (--verify, the faithfulness curve)
    edges          Which components feed which: edge attribution patching, EAP and EAP-IG, over every edge
    group_losses   Heads removed together: the model's next-token loss with a group of heads' outputs replaced
    importance     Does a head matter? Per-head importance on the model's own next-token loss
    journal        A search that survives an interruption: every answer the model gave it, saved as it came
    kv_policy      kv-policy.json: a window-mode pruning as a per-head KV-cache policy, and the memory it frees
    loss           The model's next-token loss: cross-entropy in nats at every predicted position, and per sentence
    loss_model     What `ablate` and `prune` share
    pair_removal   Heads removed on prompt pairs: the task's metric
    pairs          Prompt pairs for activation patching: read from a file (or records in memory), checked, tokenized
    patching       Activation patching on prompt pairs
    prune_passes   prune's search on a model: the loss model's passes as the pure search's `estimate`
    qk_senders     Each sender's part of a head's query and key
    qk_terms       Why a head attends where it does
    removal        How a head is removed: the one definition every intervention uses (importance, ablate, prune
    search         Which heads can go together within a loss budget: a search whose every accepted step is verified
    surgery        Removed heads written into the weights
"""
