"""Plumbing every stage shares: one-line errors, atomic outputs, safe .pt loading."""
