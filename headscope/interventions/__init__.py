"""Heads changed on purpose: how a head is removed, the loss with heads removed, importance, ablate, prune and
its search, and surgery on the weights."""
