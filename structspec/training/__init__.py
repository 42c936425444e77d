"""Training an EAGLE-3 draft head for the served model by self-distillation
(``structspec train-eagle``): prompt sets and target-generated sequences (the data side), the
target features captured in structspec's own forward, the training-time-test trainer and the
sglang / SpecForge-compatible checkpoint export; on several GPUs, one engine process per GPU
for the data (:mod:`~structspec.training.data_parallel`) and DistributedDataParallel under
``torchrun`` for the training (:mod:`~structspec.training.distributed`)."""
