"""Training an EAGLE-3 draft head by self-distillation (``structspec train-eagle``)."""
