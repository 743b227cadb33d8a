"""What is trained, against what: the DFlash drafter, its attention mask and loss, the frozen target."""
