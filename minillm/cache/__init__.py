"""KV-cache memory: the contiguous cache (chapters 00-02), paged blocks and the block manager
(chapter 03), the paged cache and its StepMetadata (chapters 03-05), prefix caching (chapter 06,
a flag of the block manager)."""
