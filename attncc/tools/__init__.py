"""Tools: the `attncc` command (show, compile, check, bench), the FlexAttention/SDPA
lowering it compares against, plots, sample inputs and the tolerance rule."""
