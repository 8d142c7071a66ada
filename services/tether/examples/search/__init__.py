"""Search agent: multi-turn question answering over a local BM25 index (Search-R1's shape)."""
