"""Training an EAGLE-3 draft head for the served model by self-distillation
(``structspec train-eagle``): prompt sets and target-generated sequences (the data side), the
target features captured in structspec's own forward, the training-time-test trainer and the
sglang / SpecForge-compatible checkpoint export."""
