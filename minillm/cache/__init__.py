"""KV-cache memory managers: contiguous slabs (chapters 01-02) and paged blocks (chapter 03)."""
