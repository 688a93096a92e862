"""Stubs generated from proto/pagedserve/v1 by `make proto` (never edited by hand)."""
