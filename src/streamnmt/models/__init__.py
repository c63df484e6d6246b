"""The Transformer and its parts: attention, masks, the chunked loss and its Triton kernel."""
