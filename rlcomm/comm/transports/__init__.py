"""Transports: move plain tensors between the two ranks of a connection."""
