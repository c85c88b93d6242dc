"""A small GPT-like Transformer and an FSDP2 training loop that exercise the checkpoint API end to end."""
