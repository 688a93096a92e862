"""`pagedserve bench`: a benchmark client for a running server (or an embedded one)."""
